"""Running the Mosaic GPU kernels on CPU under jax's GPU interpret mode (jax >= 0.12).

jax's interpreter (``plgpu.force_gpu_interpret_mode``) simulates shared memory, barriers, TMA copies
and warpgroups, but does not yet interpret two forms a FlashAttention-3 kernel uses: ``pl.run_state``
over a pre-initialized WGMMA accumulator, and a wgmma whose A operand comes from registers.
:func:`gpu_interpret_mode` teaches it both, for the time it is active, by the hardware's semantics:
``run_state`` allocates each of its value inputs (the accumulator, and the values it closes over)
holding its initial value, runs the body and returns the final values; a register A operand is
placed in a buffer first. Those buffers are private to the thread (the interpreter's register
space: a shared-memory allocation that not every thread of a block makes would put the block's
allocations out of step). Everything else is jax's own interpreter.
"""

from __future__ import annotations

import contextlib
import functools

import jax
from jax.experimental.pallas import mosaic_gpu as plgpu

try:
    from jax._src import callback
    from jax._src import core as jax_core
    from jax._src.pallas.mosaic_gpu import core as gpu_core
    from jax._src.pallas.mosaic_gpu import primitives as gpu_primitives
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
    from jax._src.pallas.mosaic_gpu.interpret import shared_memory as memory
    from jax._src.pallas.mosaic_gpu.interpret.jaxpr_interpret import JaxprInterpreter
    from jax._src.state import types as state_types
    from jax._src.state.discharge import run_state_p
    AVAILABLE = hasattr(plgpu, "force_gpu_interpret_mode")
except ImportError:  # jax < 0.12 has no Mosaic GPU interpreter.
    AVAILABLE = False

REASON = "jax's Mosaic GPU interpret mode (jax >= 0.12) is not installed"


def _a_from_registers(eqn) -> bool:
    return (eqn.primitive is gpu_primitives.wgmma_ref_p
            and not isinstance(eqn.invars[1].aval, state_types.AbstractRef))


def _needs_help(eqn) -> bool:
    return eqn.primitive is run_state_p or _a_from_registers(eqn)


def _allocate(interp, token, value, source_info):
    """A buffer private to this thread holding ``value`` (in the interpreter's register space,
    which, unlike shared memory, is not allocated in step by every thread of a block)."""
    token, request = gpu_callbacks.call_make_allocation_request_array(
        token=token, compute_unit=interp.thread,
        memory_space_id=memory.get_memory_space_idx(gpu_core.MemorySpace.REGS))
    return gpu_callbacks.call_allocate_buffer(
        token=token, mesh_location=interp.mesh_location, thread=interp.thread,
        allocation_request_as_array=request, value=value, source_info=source_info)


def _free(interp, token, key, source_info):
    return gpu_callbacks.call_deallocate_buffer(token, interp.mesh_location, interp.thread, key,
                                                source_info=source_info)


def _read(interp, token, key, aval, source_info):
    return callback.io_callback(
        functools.partial(gpu_callbacks.wgmma_accumulator_deref, source_info=source_info),
        (gpu_callbacks.TOKEN_SHAPE_DTYPE, aval), token=token,
        mesh_location=interp.mesh_location, thread=interp.thread,
        acc_allocation_key_as_array=key, wait_n=None)


def _run_state(interp, eqn, token, invals):
    """``run_state``: each value input is allocated holding its value, ref inputs pass through; the
    body runs and the allocated values are read back."""
    body = eqn.params["jaxpr"]
    args, allocated = [], []
    for value, outer in zip(invals, eqn.invars):
        if isinstance(outer.aval, state_types.AbstractRef):
            args.append(value)
            continue
        token, key = _allocate(interp, token, value, eqn.source_info)
        args.append(key)
        allocated.append(len(args) - 1)
    token, _ = interp.interpret(body, token, *args)
    outs = list(invals)
    for i in allocated:
        token, outs[i] = _read(interp, token, args[i], eqn.invars[i].aval, eqn.source_info)
        token = _free(interp, token, args[i], eqn.source_info)
    return token, outs


def _wgmma_a_from_registers(interp, eqn, token, invals):
    """A register A operand: the same wgmma with A staged in a buffer of its own."""
    acc, a, *rest = invals
    token, key = _allocate(interp, token, a, eqn.source_info)
    a_var = jax_core.Var(state_types.AbstractRef(eqn.invars[1].aval, gpu_core.MemorySpace.SMEM))
    staged = eqn.replace(invars=[eqn.invars[0], a_var, *eqn.invars[2:]])
    token, outs = interp._interpret_wgmma_ref_p(staged, token, lambda: [acc, key, *rest])
    return _free(interp, token, key, eqn.source_info), outs


def _one_equation(eqn):
    """``eqn`` as a jaxpr of its own, taking its distinct variables and returning its outputs."""
    invars = list(dict.fromkeys(v for v in eqn.invars if isinstance(v, jax_core.Var)))
    outvars = [jax_core.Var(v.aval) if isinstance(v, jax_core.DropVar) else v
               for v in eqn.outvars]
    debug_info = jax_core.DebugInfo("gpu_interpret_mode", str(eqn.primitive), None, None)
    return invars, jax_core.Jaxpr([], invars, outvars, [eqn.replace(outvars=outvars)],
                                  eqn.effects, debug_info=debug_info)


@contextlib.contextmanager
def gpu_interpret_mode(**params):
    """Runs ``plgpu.kernel`` calls under jax's GPU interpret mode (``InterpretGPUParams(**params)``)
    with the two forms above interpreted."""
    original = JaxprInterpreter.interpret

    def interpret(self, jaxpr, token, *args):
        if not any(_needs_help(eqn) for eqn in jaxpr.eqns):
            return original(self, jaxpr, token, *args)
        env = dict(zip(jaxpr.constvars + jaxpr.invars, args))

        def read(v):
            return v.val if isinstance(v, jax_core.Literal) else env[v]

        for eqn in jaxpr.eqns:
            invals = [read(v) for v in eqn.invars]
            if eqn.primitive is run_state_p:
                token, outs = _run_state(self, eqn, token, invals)
            elif _a_from_registers(eqn):
                token, outs = _wgmma_a_from_registers(self, eqn, token, invals)
            else:
                invars, single = _one_equation(eqn)
                token, outs = original(self, single, token, *(env[v] for v in invars))
            env.update(zip(eqn.outvars, outs))
        return token, [read(v) for v in jaxpr.outvars]

    JaxprInterpreter.interpret = interpret
    jax.clear_caches()  # No trace of these kernels made outside the mode may be reused in it.
    try:
        with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams(**params)):
            yield
    finally:
        JaxprInterpreter.interpret = original
        jax.clear_caches()
