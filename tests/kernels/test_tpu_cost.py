"""XLA:TPU's cycle estimate of a whole program (:mod:`pallas_kernels.tpu_cost`): loops count their
trips, Mosaic calls are counted for their own estimate, and a condition that is not ``i < N`` is
refused. The HLO here is written by hand in the optimized-HLO form libtpu prints; the last test
reads a real compile (needs libtpu)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import tpu_aot, tpu_cost


def _cost(cycles: int) -> str:
    return f'backend_config={{"flag_configs":[],"estimated_cycles":"{cycles}"}}'


def _loop(name: str, trips: int, body: list[str], compare: str = "LT") -> list[str]:
    return [
        f"%{name}.cond (arg: (s32[])) -> pred[] {{",
        f"  %{name}.n = s32[]{{:T(128)}} constant({trips})",
        f"  %{name}.i = s32[]{{:T(128)}} get-tuple-element(%arg), index=0",
        f"  ROOT %{name}.lt = pred[]{{:T(512)}} compare(%{name}.i, %{name}.n), direction={compare}",
        "}",
        f"%{name}.body (arg: (s32[])) -> (s32[]) {{",
        *body,
        "}",
    ]


def _while(name: str) -> str:
    return (f"  %{name} = (s32[]) while(%t), condition=%{name}.cond, body=%{name}.body, "
            'backend_config={"flag_configs":[]}')


MOSAIC = ('  %window_attention_tpu.3 = bf16[1,8]{1,0} custom-call(%a), custom_call_target="tpu_custom_call", '
          'backend_config={"flag_configs":[]}')


def program(inner_trips: int = 30, outer_trips: int = 4, compare: str = "LT") -> str:
    """An entry (10 cycles) running an outer loop (1 cycle per trip + an inner loop of
    ``inner_trips`` x (100 cycles and one Mosaic call)), then a commit loop of 30 x 7 cycles."""
    inner = _loop("inner", inner_trips, [f"  %mm = f32[8]{{0}} fusion(%x), kind=kOutput, calls=%f, {_cost(100)}",
                                         MOSAIC], compare)
    outer = _loop("outer", outer_trips, [f"  %step = s32[] add(%i, %one), {_cost(1)}", _while("inner")])
    commit = _loop("commit", 30, [f"  %c = f32[8]{{0}} fusion(%x), kind=kLoop, calls=%g, {_cost(7)}"])
    entry = ["ENTRY %main (p: f32[8]) -> f32[8] {", f"  %e = f32[8]{{0}} fusion(%p), kind=kLoop, calls=%h, {_cost(10)}",
             _while("outer"), _while("commit"), "}"]
    return "\n".join(["HloModule m, is_scheduled=true", ""] + inner + outer + commit + entry)


def test_loops_count_their_trips_and_kernels_are_counted_apart():
    cost = tpu_cost.program_cycles(program())
    assert cost.cycles == 10 + 4 * (1 + 30 * 100) + 30 * 7
    assert cost.kernel_calls == {("window_attention_tpu", 1): 4 * 30}
    assert [t for _, t in cost.loops] == [4, 30, 30]


def test_kernel_calls_are_keyed_by_the_rows_they_run():
    """A Mosaic call's rows are its (first) result's leading dimension: a batch run whole and one
    run row by row inside a loop are priced at their own rows."""
    tuple_result = MOSAIC.replace("bf16[1,8]{1,0}", "(bf16[4,8]{1,0}, f32[4]{0})")
    cost = tpu_cost.program_cycles(program().replace(MOSAIC, MOSAIC + "\n" + tuple_result))
    assert cost.kernel_calls == {("window_attention_tpu", 1): 4 * 30, ("window_attention_tpu", 4): 4 * 30}


def test_a_kernel_is_named_without_the_suffixes_xla_adds():
    """XLA names a Mosaic call after its kernel, then adds ``.N`` and, where the call feeds a named
    operand, that name (``upsample_conv2d_tpu_....1.refs_1_``): the call is counted by its kernel."""
    suffixed = MOSAIC.replace("%window_attention_tpu.3", "%window_attention_tpu.3.refs_1_")
    cost = tpu_cost.program_cycles(program().replace(MOSAIC, suffixed))
    assert cost.kernel_calls == {("window_attention_tpu", 1): 4 * 30}


def test_the_estimate_follows_the_trip_counts():
    small, large = (tpu_cost.program_cycles(program(inner_trips=n)) for n in (3, 30))
    assert large.cycles - small.cycles == 4 * 27 * 100
    assert large.kernel_calls["window_attention_tpu", 1] == 10 * small.kernel_calls["window_attention_tpu", 1]


def test_the_cost_models_unknown_is_counted_apart():
    text = program().replace(_cost(7), _cost(2**64 - 1))
    cost = tpu_cost.program_cycles(text)
    assert cost.cycles == 10 + 4 * (1 + 30 * 100) and cost.unpriced == 30


def _copy(cycles: int, iterations: tuple[int, ...] = (1, 19)) -> str:
    bounds = ",".join(f'"{n}"' for n in iterations)
    return ('  %c = bf16[4680,1536]{0,1:T(8,128)(2,1)} copy(%x), backend_config={"flag_configs":[],'
            f'"window_config":{{"estimated_cycles":"{cycles}","iteration_bounds":[{bounds}]}}}}')


def test_placeholder_copies_cost_their_bytes_round_trip_at_the_given_rate():
    """A copy priced 100 cycles per window iteration is repriced as its result read and written at
    ``hbm_bytes_per_cycle`` (with the loop's trips); a copy with a real estimate keeps it, and
    without a rate the placeholder stays as it is."""
    size = 4680 * 1536 * 2
    placeholder = program().replace(f"{_cost(7)}", f"{_cost(7)}\n{_copy(1900)}")
    plain = tpu_cost.program_cycles(placeholder)
    assert plain.cycles == 10 + 4 * (1 + 30 * 100) + 30 * (7 + 1900)
    assert (plain.placeholder_copies, plain.placeholder_copy_bytes) == (30, 30 * size)
    repriced = tpu_cost.program_cycles(placeholder, hbm_bytes_per_cycle=1000.0)
    assert repriced.cycles == 10 + 4 * (1 + 30 * 100) + 30 * (7 + round(2 * size / 1000.0))
    priced = tpu_cost.program_cycles(program().replace(f"{_cost(7)}", f"{_cost(7)}\n{_copy(73720)}"), 1000.0)
    assert priced.cycles == 10 + 4 * (1 + 30 * 100) + 30 * (7 + 73720) and priced.placeholder_copies == 0


def test_result_bytes_reads_every_array_of_a_result():
    assert tpu_cost.result_bytes(_copy(1900)) == 4680 * 1536 * 2
    line = "  %t = (f32[4680]{0:T(1024)}, bf16[2,3]{1,0}, pred[]) fusion(%x), kind=kLoop"
    assert tpu_cost.result_bytes(line) == 4680 * 4 + 6 * 2 + 1
    with pytest.raises(ValueError, match="c64"):
        tpu_cost.result_bytes("  %z = c64[4]{0} copy(%x)")


def test_a_condition_that_is_not_a_counted_loop_is_refused():
    with pytest.raises(ValueError, match="trip count"):
        tpu_cost.program_cycles(program(compare="NE"))


def test_text_without_an_entry_is_refused():
    with pytest.raises(ValueError, match="ENTRY"):
        tpu_cost.program_cycles("HloModule m\n")


@pytest.mark.slow
@pytest.mark.skipif(not tpu_aot.libtpu_available(), reason="libtpu is not installed (pip install -e '.[tpu]')")
def test_a_compiled_scan_costs_its_trips():
    """A real compile for v6e: a scan of ``n`` 1024-square matmuls costs about ``n`` times one, and
    one matmul is within the chip's peak (its estimate is not below the FLOPs at peak)."""
    def scan(n):
        def fn(x, w):
            return jax.lax.scan(lambda c, wi: (jnp.tanh(c @ wi), None), x, w)[0]
        compiled = tpu_aot.compile_for_tpu(fn, [((1024, 1024), jnp.bfloat16), ((n, 1024, 1024), jnp.bfloat16)], "v6e")
        return tpu_cost.program_cycles(compiled.as_text())

    one, eight = scan(1), scan(8)
    assert [t for _, t in eight.loops] == [8] or eight.cycles > 7 * one.cycles
    per_matmul = (eight.cycles - one.cycles) / 7
    chip = tpu_aot.CHIPS["v6e"]
    assert per_matmul / chip.clock_hz >= 2 * 1024**3 / chip.bf16_flops
    assert eight.cycles == pytest.approx(8 * per_matmul, rel=0.25)


def test_the_first_query_blocks_rotation_counts_once_per_row_and_head():
    """In the paged kernel's grid loop a segment with lane rotations and no MXU op (the tail's
    rotation, done at a (row, head)'s first query block) counts once per query blocks; other
    segments whole."""
    from pallas_kernels.window_attention import tpu_estimate

    segments = [["vadd"] * 3, ["vrot.lane"] * 4, ["vmatmul"] * 5, ["vmatmul vsel"] * 6, ["vst"] * 2]
    bundles = [("PF" if i == 0 else "", 1, text) for seg in segments for i, text in enumerate(seg)]
    node = dict(start=0, depth=1, own=len(bundles), children=[], mxu=11)
    assert tpu_estimate._fast_own(bundles, node) == 3 + 4 + 5 + 6 + 2
    assert tpu_estimate._fast_own(bundles, node, q_blocks=2) == 3 + 2 + 5 + 6 + 2


def test_a_history_block_of_full_pages_counts_its_own_region():
    """The history-block loop counts its own region (a block of full pages, unrolled) times the
    blocks and not its page loop (blocks with a partial page); the tail's chunks are the grid
    loop's updates before the history loop, which hide the first block's DMAs."""
    from pallas_kernels.window_attention import tpu_estimate

    def region(n, text, depth, mark="PF"):
        return [(mark if i == 0 else "", depth, text) for i in range(n)]

    bundles = (region(2, "sadd", 1, "LB") + region(10, "vmatmul", 1)  # grid loop: the tail's chunks
               + region(3, "sld", 2, "LB") + region(20, "vmatmul", 2)  # history loop: a full block
               + region(7, "vmatmul", 3, "LB") + region(9, "vmatmul vsel", 3)  # page loop
               + region(4, "vmatmul vsel", 1) + region(1, "vst", 1))  # pooled chunk, output
    tree = tpu_estimate.loop_tree(bundles)
    trips = dict(sub_blocks=1, pages_per_block=3, q_blocks=2, full_tail=0, blocks=3, retry=False)
    cycles, tail, _ = tpu_estimate.attention_cycles(tree, trips, bundles)
    assert tail == 10
    assert cycles == (2 + 10 + 4 + 1) + 3 * (3 + 20)

    # With fixed row maxima the grid loop ends with the overflow check and the online pass, a loop
    # of 0 trips unless a step overflows: the check counts, the pass does not.
    retry = (region(6, "vadd", 1) + region(2, "sadd", 2, "LB") + region(30, "vmatmul", 2)
             + region(5, "sld", 3, "LB") + region(40, "vmatmul", 3))
    tree = tpu_estimate.loop_tree(bundles + retry)
    cycles, tail, _ = tpu_estimate.attention_cycles(tree, dict(trips, retry=True), bundles + retry)
    assert (cycles, tail) == ((2 + 10 + 4 + 1 + 6) + 3 * (3 + 20), 10)


@pytest.mark.slow
@pytest.mark.skipif(not tpu_aot.libtpu_available(), reason="libtpu is not installed (pip install -e '.[tpu]')")
def test_the_paged_kernels_estimate_is_within_the_chip_and_grows_with_rows():
    """The paged kernel's bundle estimate at wan-1.3b's steady-state window (9 history frames + the
    chunk), for v5e: never faster than its FLOPs at bf16 peak, and two rows cost about twice one."""
    from pallas_kernels.window_attention import WindowGeometry, tpu_estimate

    def geometry(rows):
        return WindowGeometry(rows, 4680, 12, 12, 128, 4680, 0, 2, rows * 9 + 1, 1560, 9, 1560)

    one, two = (tpu_estimate.estimate(geometry(r), "bfloat16", "v5e") for r in (1, 2))
    flops = 4 * 4680 * (9 * 1560 + 4680) * 12 * 128
    assert one.seconds >= flops / tpu_aot.CHIPS["v5e"].bf16_flops
    assert two.grid_steps == 2 * one.grid_steps
    assert two.seconds == pytest.approx(2 * one.seconds, rel=0.1)


@pytest.mark.slow
@pytest.mark.skipif(not tpu_aot.libtpu_available(), reason="libtpu is not installed (pip install -e '.[tpu]')")
def test_the_compiler_says_how_much_hbm_a_program_may_use():
    """A little under each chip's nominal HBM (16 and 32 GiB), and a program of that size compiles
    while one a GiB larger does not."""
    for gen, nominal in (("v5e", 16 << 30), ("v6e", 32 << 30)):
        usable = tpu_aot.available_hbm_bytes(gen)
        assert 0.95 * nominal < usable < nominal
    usable = tpu_aot.available_hbm_bytes("v5e")
    fits = (usable - (256 << 20)) // 2 // 2  # input and output bf16 arrays
    tpu_aot.compile_for_tpu(lambda x: x + 1, [((fits,), jnp.bfloat16)], "v5e")
    with pytest.raises(Exception, match="CompileTimeHbmOom"):
        tpu_aot.compile_for_tpu(lambda x: x + 1, [((fits + (1 << 29),), jnp.bfloat16)], "v5e")


@pytest.mark.slow
@pytest.mark.skipif(not tpu_aot.libtpu_available(), reason="libtpu is not installed (pip install -e '.[tpu]')")
def test_a_real_layout_copy_gets_the_placeholder_and_is_repriced():
    """Compiled for v6e, a head-major relayout of a ``[4680, 1536]`` bf16 array (scaled first, so
    it is not a parameter's layout) goes through a copy priced at the cost model's placeholder;
    with the chip's rate it costs at least its bytes' round trip through HBM."""
    def fn(x):
        return (x * 2).reshape(4680, 12, 128).transpose(1, 0, 2) * 3
    hlo = tpu_aot.compile_for_tpu(fn, [((4680, 1536), jnp.bfloat16)], "v6e").as_text()
    chip = tpu_aot.CHIPS["v6e"]
    plain, repriced = tpu_cost.program_cycles(hlo), tpu_cost.program_cycles(hlo, chip.hbm_bytes_per_cycle)
    assert plain.placeholder_copies >= 1
    added = repriced.cycles - plain.cycles
    assert added >= plain.placeholder_copies * (2 * 4680 * 1536 * 2 / chip.hbm_bytes_per_cycle - 100 * 19) - 1
