"""The magnitudes that explain a non-finite value (cublas_guard_ext/errors/magnitudes.py)."""

import math

import pytest

from cublas_guard_ext.errors import magnitudes as mg


@pytest.mark.parametrize(
    "dtype, label, largest",
    [
        ("Half", "float16", 65504.0),
        ("torch.float16", "float16", 65504.0),
        ("BFloat16", "bfloat16", 3.3895313892515355e38),
        ("torch.float32", "float32", 3.4028234663852886e38),
        ("Double", "float64", 1.7976931348623157e308),
    ],
)
def test_format_max_knows_every_name(dtype, label, largest):
    assert mg.format_max(dtype) == (label, largest)


def test_format_max_of_a_non_float_is_none():
    assert mg.format_max("Long") is None


def test_an_input_beyond_the_range_is_named():
    assert mg.range_note("Half", 70000.0) == "70000 exceeds the float16 range 65504"


def test_an_input_near_the_limit_is_named():
    note = mg.range_note("torch.float16", 40000.0)
    assert note.startswith("40000 is near the float16 limit 65504")


def test_a_product_of_values_beyond_the_square_root_is_named():
    assert mg.range_note("Half", 300.0) is None
    assert "squared exceeds the float16 range 65504" in mg.range_note("Half", 300.0, is_product=True)


def test_small_or_unknown_magnitudes_say_nothing():
    assert mg.range_note("Float", 1e10) is None
    assert mg.range_note("Float", None) is None
    assert mg.range_note("Float", math.inf) is None
    assert mg.range_note("Long", 1e30) is None


def test_magnitude_line_lists_every_input_and_the_note():
    line = mg.magnitude_line([1.5, None, 1e5], "Half")
    assert line == "inputs' absolute maxima: 1.5, ?, 100000 (100000 exceeds the float16 range 65504)"
    assert mg.magnitude_line([2.0, 3.0], "Float") == "inputs' absolute maxima: 2, 3"
    assert mg.magnitude_line([], "Float") is None
    assert mg.magnitude_line([None], "Float") is None


def test_counts_line_writes_the_known_counts():
    assert mg.counts_line({"nan_count": 3, "posinf_count": 1, "neginf_count": 0, "zero_count": 12}) == (
        "NaN 3, +Inf 1, -Inf 0, zeros 12"
    )
    assert mg.counts_line({"nan_count": 2}) == "NaN 2"
    assert mg.counts_line({}) is None
