import math

import pytest

from bigbatch.config.scaling import RULES, scale_factor, scale_lr


@pytest.mark.parametrize(
    ("scale", "rule", "expected"),
    [
        (32, "linear", 3.2),
        (4, "sqrt", 0.2),
        (2, "sqrt", 0.1 * math.sqrt(2)),
        (32, "none", 0.1),
        (1, "linear", 0.1),
        (1, "sqrt", 0.1),
        (0.5, "linear", 0.05),  # a batch below the base shrinks the LR by the same rule
        (0.25, "sqrt", 0.05),
    ],
)
def test_scale_lr(scale, rule, expected):
    assert scale_lr(0.1, scale, rule) == pytest.approx(expected, rel=1e-15)


def test_scale_factor_is_the_multiplier():
    for rule in RULES:
        assert scale_lr(0.3, 16, rule) == pytest.approx(0.3 * scale_factor(16, rule))
    assert scale_factor(16, "linear") == 16.0
    assert scale_factor(16, "sqrt") == 4.0
    assert scale_factor(16, "none") == 1.0


def test_unknown_rule():
    with pytest.raises(ValueError, match="unknown scaling rule 'cubic'; expected one of linear"):
        scale_lr(0.1, 2, "cubic")


@pytest.mark.parametrize("scale", [0, -1, float("nan"), float("inf")])
def test_bad_scale(scale):
    with pytest.raises(ValueError, match="batch scale must be a finite number > 0"):
        scale_lr(0.1, scale, "linear")
