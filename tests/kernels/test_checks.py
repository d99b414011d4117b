"""The one rule for int, real and bool arguments (:mod:`pallas_kernels.checks`), shared by the
kernels and ``arkv_jax.config``: NumPy integers are ints (returned as Python ints), bools are not;
a wrong type is an ``ArgumentTypeError`` (a ``TypeError``), a value out of range a ``ValueError``,
and both name the parameter and the value."""

from __future__ import annotations

import ast
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

import arkv_jax.config as config
from pallas_kernels import checks
from pallas_kernels.checks import ArgumentTypeError, require_bool, require_int, require_real
from pallas_kernels.layout import pool_shape, tpu_block_size
from pallas_kernels.paged_write import static_validate_inputs as write_static_validate
from pallas_kernels.window_attention import static_validate_inputs as attention_static_validate

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_numpy_integers_are_ints_and_come_back_as_python_ints():
    for value in (5, np.int64(5), np.int32(5), np.uint8(5)):
        got = require_int("n", value, minimum=1)
        assert got == 5 and type(got) is int
    assert pool_shape(np.int64(2), np.int32(3), np.int64(8), 1, np.int16(4)) == (2, 1, 3, 8, 4)
    assert all(type(d) is int for d in pool_shape(np.int64(2), np.int32(3), np.int64(8), 1, np.int16(4)))
    assert tpu_block_size(np.int64(220)) == 224


@pytest.mark.parametrize("value", [True, np.bool_(False), 2.0, "3", None, np.float32(1.0)])
def test_bools_floats_and_strings_are_not_ints(value):
    with pytest.raises(TypeError, match=r"^block_q must be an int in \[1, inf\], got .* expected an int\)$") as info:
        require_int("block_q", value, minimum=1)
    assert isinstance(info.value, ArgumentTypeError) and isinstance(info.value, ValueError)


def test_range_errors_are_value_errors_naming_the_parameter_and_the_value():
    with pytest.raises(ValueError, match=r"^n must be an int in \[1, 4\], got 7$") as info:
        require_int("n", np.int64(7), minimum=1, maximum=4)
    assert not isinstance(info.value, TypeError)
    with pytest.raises(ValueError, match=r"^n must be a positive multiple of 8, got 12$"):
        require_int("n", 12, minimum=8, multiple_of=8, must="a positive multiple of 8")
    with pytest.raises(ValueError, match=r"^x must be a finite real number in \(0.0, inf\], got nan$"):
        require_real("x", float("nan"), low=0.0, low_open=True)
    with pytest.raises(TypeError, match=r"^x must be .*, got True \(bool, expected a real number\)$"):
        require_real("x", True)
    assert require_real("x", np.float32(0.5)) == 0.5 and require_bool("b", np.bool_(True)) is True
    with pytest.raises(TypeError, match=r"^b must be a bool \(True or False\), got 0 \(int, expected a bool\)$"):
        require_bool("b", 0)


def test_arkv_jax_config_takes_the_rule_from_the_kernels():
    for name in ("ArgumentTypeError", "require_int", "require_real", "require_bool", "require_positive",
                 "require_non_negative"):
        assert getattr(config, name) is getattr(checks, name), name
    geometry = config.CacheGeometry(np.int64(2), 1, 8, "float32", np.int32(4))
    assert type(geometry.num_layers) is int and type(geometry.block_size) is int
    with pytest.raises(ArgumentTypeError, match=r"^num_layers must be positive, got True \(bool, expected an int\)$"):
        config.CacheGeometry(True, 1, 8, "float32", 4)


def test_the_kernels_take_numpy_integers_and_refuse_bools():
    pool = jnp.zeros(pool_shape(1, 4, 8, 1, 8))
    new = jnp.zeros((1, 1, 8, 1, 8))
    ids = jnp.ones((1, 1), jnp.int32)
    assert write_static_validate(pool, pool, new, new, ids, tokens_per_frame=np.int64(8)) == 8
    with pytest.raises(TypeError, match=r"^tokens_per_frame must be a positive int, got True \(bool"):
        write_static_validate(pool, pool, new, new, ids, tokens_per_frame=True)
    q = jnp.zeros((1, 8, 1, 8))
    args = (q, q, q, pool, pool, jnp.ones((1, 2), jnp.int32), jnp.zeros((1,), jnp.int32))
    geom = attention_static_validate(*args, tokens_per_frame=np.int64(8), block_q=np.int32(16),
                                     scale=np.float32(0.5), layer=np.int64(0))
    assert type(geom.tokens_per_frame) is int
    with pytest.raises(TypeError, match=r"^block_k must be None or a positive int"):
        attention_static_validate(*args, block_k=np.bool_(True))
    with pytest.raises(TypeError, match=r"^layer must be an integer scalar"):
        attention_static_validate(*args, layer=np.bool_(False))
    with pytest.raises(TypeError, match=r"^scale must be a positive finite number"):
        attention_static_validate(*args, scale=True)


def test_an_index_is_an_int_in_range_or_an_integer_scalar_array():
    """:func:`checks.require_index`, shared by window attention's ``layer`` and the causal
    convolution's ``stream``: ints are range-checked, integer scalar arrays (concrete or traced)
    pass for the caller to check or clamp, anything else is refused."""
    for ok in (0, 2, np.int64(1), jnp.int32(7), np.asarray(9, np.uint8)):
        checks.require_index("layer", ok, 3, "k_pool.shape[0]")
    with pytest.raises(ValueError, match=r"^layer=3 is out of range; allowed \[0, 3\) \(k_pool.shape\[0\]\)$"):
        checks.require_index("layer", 3, 3, "k_pool.shape[0]")
    with pytest.raises(ValueError, match=r"^layer=-1 is out of range"):
        checks.require_index("layer", np.int32(-1), 3, "k_pool.shape[0]")
    for bad in (True, 1.0, jnp.float32(1), "1", None):
        with pytest.raises(ArgumentTypeError, match="^layer must be an integer scalar"):
            checks.require_index("layer", bad, 3, "k_pool.shape[0]")
    with pytest.raises(ValueError, match=r"^layer must be an int scalar, got shape \(2,\)$"):
        checks.require_index("layer", jnp.zeros(2, jnp.int32), 3, "k_pool.shape[0]")


def test_no_kernel_module_writes_its_own_int_check():
    """``isinstance(..., bool)`` appears in :mod:`pallas_kernels.checks` only."""
    offenders = []
    for path in sorted((ROOT / "pallas_kernels").rglob("*.py")):
        if path.name == "checks.py" and path.parent.name == "pallas_kernels":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance" and "bool" in \
                    ast.unparse(node.args[1]):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == []
