import dataclasses
from pathlib import Path

import pytest

from bigbatch.config.strategy import (
    AmpConfig,
    BatchConfig,
    BatchPlan,
    LarsConfig,
    RecomputeConfig,
    Strategy,
)
from bigbatch.errors import ConfigError

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

# Seed 000 (Fleet's LARS / LAMB docs), written as bigbatch TOML.
FLEET_LARS = """
[lars]
lars_coeff = 0.001
lars_weight_decay = 0.0005
exclude_from_weight_decay = ['batch_norm', '.b_0']
"""
FLEET_LAMB = """
[optimizer]
type = "adamw"

[lamb]
lamb_weight_decay = 0.01
exclude_from_weight_decay = ['layer_norm']
"""
EVERYTHING = """
[batch]
global_batch_size = 2048
micro_batch_size = 32
base_batch_size = 128
base_lr = 0.2
scaling = "sqrt"
warmup_epochs = 1.5
decay = "step"
decay_power = 2
decay_milestones = [0.25, 0.5]
decay_gamma = 0.5
final_lr_ratio = 0.01

[optimizer]
momentum = 0.95
nesterov = true
beta1 = 0.8

[lars]
lars_coeff = 0.02
exclude_from_weight_decay = ["bn", "bias"]
trust_clip = true

[lamb]
enable = false
max_grad_norm = 2.0

[gradient_merge]
avg = false

[amp]
dtype = "bfloat16"
init_loss_scaling = 1024

[recompute]
checkpoints = ["blocks.0", "blocks.1"]

[data_parallel]
backend = "gloo"
sync_batch_norm = true
reduce = "adasum"

[adaptive]
lr = "none"
batch_size = "goodput"
min_batch_size = 512
max_batch_size = 8192
noise_scale = true
"""


def error(text_or_dict) -> str:
    with pytest.raises(ConfigError) as info:
        if not isinstance(text_or_dict, str | Path):
            Strategy.from_dict(text_or_dict)
        else:
            Strategy.from_toml(text_or_dict)
    msg = str(info.value)
    assert "\n" not in msg, msg
    return msg


# -- defaults, loading, round trip -----------------------------------------------------


def test_default_is_plain_momentum_sgd():
    s = Strategy()
    assert s.optimizer.type == "momentum" and s.optimizer_name() == "momentum"
    assert not any(getattr(s, n).enable for n in ("lars", "lamb", "gradient_merge", "amp"))
    assert not s.recompute.enable and not s.adaptive.active
    assert s.resolve(1) == BatchPlan(256, 256, 1, 1, 1.0, 0.1)


def test_fleet_seed_examples_load():
    lars = Strategy.from_toml(FLEET_LARS)
    assert lars.lars.enable and lars.optimizer_name() == "LARS"
    assert lars.lars.lars_coeff == 0.001 and lars.lars.lars_weight_decay == 0.0005
    assert lars.lars.exclude_from_weight_decay == ("batch_norm", ".b_0")
    lamb = Strategy.from_toml(FLEET_LAMB)
    assert lamb.lamb.enable and lamb.optimizer_name() == "LAMB"
    assert lamb.lamb.exclude_from_weight_decay == ("layer_norm",)


@pytest.mark.parametrize(
    "text",
    ["", FLEET_LARS, FLEET_LAMB, EVERYTHING]
    # study_*.toml configure `bigbatch study`, not a Strategy.
    + [p.read_text() for p in sorted(EXAMPLES.glob("*.toml")) if not p.name.startswith("study_")],
)
def test_toml_round_trip(text):
    s = Strategy.from_toml(text)
    dumped = s.to_toml()
    again = Strategy.from_toml(dumped)
    assert again == s
    assert again.to_toml() == dumped
    assert Strategy.from_dict(s.to_dict()) == s


def test_everything_loads_with_types():
    s = Strategy.from_toml(EVERYTHING)
    assert s.batch.decay_power == 2.0 and isinstance(s.batch.decay_power, float)
    assert s.amp.init_loss_scaling == 1024.0 and isinstance(s.amp.init_loss_scaling, float)
    assert s.lars.enable and not s.lamb.enable and s.lamb.max_grad_norm == 2.0
    assert s.recompute.checkpoints == ("blocks.0", "blocks.1")
    assert s.adaptive.active and s.data_parallel.reduce == "adasum"
    assert s.gradient_merge.enable and s.gradient_merge.k_steps is None


def test_examples_exist_and_resolve():
    lars = Strategy.from_toml(EXAMPLES / "lars_mnist1d.toml")
    assert lars.optimizer_name() == "LARS"
    assert lars.resolve(2) == BatchPlan(4096, 512, 4, 2, 32.0, pytest.approx(3.2))
    lamb = Strategy.from_toml(str(EXAMPLES / "lamb.toml"))
    assert lamb.optimizer_name() == "LAMB" and lamb.amp.dtype == "bfloat16"
    assert lamb.resolve(1).k_steps == 16


def test_from_toml_path_errors(tmp_path):
    assert "cannot read strategy file" in error(str(tmp_path / "missing.toml"))
    bad = tmp_path / "bad.toml"
    bad.write_text("[lars\n")
    assert error(bad).startswith(f"{bad}: invalid TOML:")
    assert error("[batch]\nbase_lr = = 1").startswith("<toml text>: invalid TOML:")


def test_section_presence_and_enable():
    assert Strategy.from_toml("[amp]").amp.enable
    assert not Strategy.from_toml("[amp]\nenable = false").amp.enable
    # fields of a disabled section are still validated
    assert "amp.incr_ratio must be in (1, 1e+06], got 0.5" in error("[amp]\nenable=false\nincr_ratio=0.5")
    # a section object on its own is on; Strategy's defaults are off
    assert LarsConfig().enable and not Strategy().lars.enable


def test_direct_construction_validates_and_coerces():
    s = Strategy(batch=BatchConfig(base_lr=1), lars=LarsConfig(), amp={"dtype": "bfloat16"})
    assert s.batch.base_lr == 1.0 and isinstance(s.batch.base_lr, float)
    assert s.amp == AmpConfig(dtype="bfloat16")
    assert s.lars.exclude_from_weight_decay is None  # the ndim <= 1 rule
    assert LarsConfig(exclude_from_weight_decay=["bn"]).exclude_from_weight_decay == ("bn",)
    with pytest.raises(ConfigError, match="lars.lars_coeff must be > 0, got 0.0"):
        LarsConfig(lars_coeff=0)
    with pytest.raises(ConfigError, match=r"\[batch\] must be a BatchConfig, got int"):
        Strategy(batch=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.batch.base_lr = 0.5


# -- validation messages -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # unknown names, with the closest valid one
        ("[lars]\nlars_coef = 0.1", "unknown key lars.lars_coef; did you mean `lars_coeff`?"),
        (
            "[gradient_merge]\nk_step = 2",
            "unknown key gradient_merge.k_step; did you mean `k_steps`?",
        ),
        ("[lars]\nmomentum = 0.9", "unknown key lars.momentum; `momentum` belongs in [optimizer]"),
        ("[lars]\nzzz = 1", "unknown key lars.zzz; valid keys: enable, lars_coeff,"),
        ("[larss]", "unknown section [larss]; did you mean `[lars]`?"),
        (
            "[lars_configs]\nlars_coeff = 0.1",
            "unknown section [lars_configs]; did you mean `[lars]`?",
        ),
        ("[zzz]", "unknown section [zzz]; valid sections: batch, optimizer, lars,"),
        ("k_steps = 4", "unknown top-level key `k_steps`; it belongs in [gradient_merge]"),
        ("lars = true", "`lars` must be a section: write [lars] with its keys (enable = true"),
        # types: key, got, expected
        ("[batch]\nbase_lr = 'x'", "batch.base_lr: expected float, got str 'x'"),
        ("[batch]\nbase_lr = true", "batch.base_lr: expected float, got bool True"),
        ("[batch]\nwarmup_steps = true", "batch.warmup_steps: expected int, got bool True"),
        ("[batch]\nwarmup_steps = 1.5", "batch.warmup_steps: expected int, got float 1.5"),
        (
            "[batch]\nglobal_batch_size = '4k'",
            "batch.global_batch_size: expected int or none, got str",
        ),
        (
            "[lars]\nexclude_from_weight_decay = 'bn'",
            "lars.exclude_from_weight_decay: expected a list, got the string 'bn'; write "
            "[\"bn\"] (on the command line: --set 'lars.exclude_from_weight_decay=[\"bn\"]')",
        ),
        (
            "[lars]\nexclude_from_weight_decay = '[bn, bias]'",
            "lars.exclude_from_weight_decay: '[bn, bias]' is not a TOML list: quote each "
            "string, e.g. --set 'lars.exclude_from_weight_decay=[\"a\", \"b\"]'",
        ),
        (
            "[lars]\nexclude_from_weight_decay = [1]",
            "lars.exclude_from_weight_decay: expected list of str or none, got int 1",
        ),
        ("[amp]\nenable = 1", "amp.enable: expected bool, got int 1"),
        ("[batch]\nbase_lr = inf", "batch.base_lr must be a finite number, got inf"),
        # ranges and choices
        ("[lars]\nlars_coeff = 0", "lars.lars_coeff must be > 0, got 0.0"),
        ("[lars]\nlars_weight_decay = -1e-4", "lars.lars_weight_decay must be >= 0, got -0.0001"),
        ("[lars]\nepsilon = -1", "lars.epsilon must be >= 0, got -1.0"),
        ("[lamb]\nlamb_weight_decay = -1", "lamb.lamb_weight_decay must be >= 0, got -1.0"),
        ("[lamb]\nmax_grad_norm = 0", "lamb.max_grad_norm must be > 0, got 0.0"),
        ("[optimizer]\nweight_decay = -1", "optimizer.weight_decay must be >= 0, got -1.0"),
        ("[optimizer]\nmomentum = 1", "optimizer.momentum must be in [0, 1), got 1.0"),
        ("[optimizer]\nbeta1 = 1.0", "optimizer.beta1 must be in [0, 1), got 1.0"),
        ("[optimizer]\nbeta2 = -0.1", "optimizer.beta2 must be in [0, 1), got -0.1"),
        ("[optimizer]\nepsilon = -1e-8", "optimizer.epsilon must be >= 0, got -1e-08"),
        (
            "[optimizer]\ntype = 'adam'",
            "optimizer.type must be one of momentum, adamw; got 'adam'; did you mean `adamw`?",
        ),
        (
            "[optimizer]\nnesterov = true\nmomentum = 0",
            "optimizer.nesterov = true needs optimizer.momentum > 0",
        ),
        ("[gradient_merge]\nk_steps = 0", "gradient_merge.k_steps must be >= 1, got 0"),
        ("[amp]\nincr_ratio = 1", "amp.incr_ratio must be in (1, 1e+06], got 1.0"),
        ("[amp]\ndecr_ratio = 1", "amp.decr_ratio must be in (0, 1), got 1.0"),
        ("[amp]\ndecr_ratio = 0", "amp.decr_ratio must be in (0, 1), got 0.0"),
        ("[amp]\ninit_loss_scaling = 0", "amp.init_loss_scaling must be in (0, 1e+30], got 0.0"),
        ("[amp]\nincr_every_n_steps = 0", "amp.incr_every_n_steps must be >= 1, got 0"),
        ("[amp]\ndecr_every_n_nan_or_inf = 0", "amp.decr_every_n_nan_or_inf must be >= 1, got 0"),
        ("[amp]\ndtype = 'float32'", "amp.dtype must be one of float16, bfloat16; got 'float32'"),
        ("[batch]\nscaling = 'lin'", "batch.scaling must be one of linear, sqrt, none; got 'lin'"),
        (
            "[batch]\ndecay = 'cos'",
            "batch.decay must be one of cosine, poly, step, none; got 'cos'",
        ),
        ("[batch]\nglobal_batch_size = 0", "batch.global_batch_size must be >= 1, got 0"),
        ("[batch]\nmicro_batch_size = -4", "batch.micro_batch_size must be >= 1, got -4"),
        ("[batch]\nbase_batch_size = 0", "batch.base_batch_size must be >= 1, got 0"),
        ("[batch]\nbase_lr = 0", "batch.base_lr must be > 0, got 0.0"),
        ("[batch]\nwarmup_steps = -1", "batch.warmup_steps must be >= 0, got -1"),
        ("[batch]\nwarmup_epochs = -1", "batch.warmup_epochs must be >= 0, got -1.0"),
        (
            "[batch]\nwarmup_steps = 5\nwarmup_epochs = 1",
            "batch.warmup_steps=5 and batch.warmup_epochs=1.0 are both set",
        ),
        ("[batch]\ndecay_power = 0", "batch.decay_power must be > 0, got 0.0"),
        ("[batch]\ndecay_gamma = 0", "batch.decay_gamma must be in (0, 1], got 0.0"),
        ("[batch]\nfinal_lr_ratio = 1.5", "batch.final_lr_ratio must be in [0, 1], got 1.5"),
        (
            "[batch]\ndecay_milestones = [0.5, 0.3]",
            "batch.decay_milestones must be strictly increasing fractions in (0, 1), got [0.5, 0.3]",
        ),
        (
            "[batch]\ndecay_milestones = [0.5, 1.0]",
            "batch.decay_milestones must be strictly increasing fractions in (0, 1)",
        ),
        (
            "[batch]\ndecay_milestones = [0.5, 0.5]",
            "batch.decay_milestones must be strictly increasing",
        ),
        ("[batch]\ndecay = 'step'", 'batch.decay_milestones is empty but batch.decay = "step"'),
        (
            "[data_parallel]\nbackend = 'mpi'",
            "data_parallel.backend must be one of auto, gloo, nccl; got 'mpi'",
        ),
        ("[data_parallel]\nbucket_cap_mb = 0", "data_parallel.bucket_cap_mb must be in (0, 1e+06], got 0.0"),
        (
            "[data_parallel]\nreduce = 'sum'",
            "data_parallel.reduce must be one of mean, adasum, fp16, bf16, powersgd, dgc; got 'sum'",
        ),
        ("[data_parallel]\ntimeout_s = 0", "data_parallel.timeout_s must be in (0, 604800], got 0.0"),
        ("[adaptive]\nlr = 'adam'", "adaptive.lr must be one of none, adascale; got 'adam'"),
        (
            "[adaptive]\nbatch_size = 'auto'",
            "adaptive.batch_size must be one of fixed, goodput; got 'auto'",
        ),
        ("[adaptive]\ninterval_steps = 0", "adaptive.interval_steps must be >= 1, got 0"),
        ("[adaptive]\ngns_ema = 1", "adaptive.gns_ema must be in [0, 1), got 1.0"),
        ("[adaptive]\ngain_threshold = -1", "adaptive.gain_threshold must be >= 0, got -1.0"),
        ("[adaptive]\nmin_batch_size = 0", "adaptive.min_batch_size must be >= 1, got 0"),
        (
            "[adaptive]\nmin_batch_size = 64\nmax_batch_size = 32",
            "adaptive.min_batch_size=64 is larger than adaptive.max_batch_size=32",
        ),
        ("[recompute]", "recompute.checkpoints is empty"),
        # combinations
        ("[lars]\n[lamb]", "[lars] and [lamb] are both enabled; enable at most one of them"),
        (
            "[lars]\n[optimizer]\ntype = 'adamw'",
            '[lars] needs optimizer.type = "momentum" (LARS wraps momentum SGD), got "adamw"',
        ),
        ("[lamb]", '[lamb] needs optimizer.type = "adamw" (LAMB wraps AdamW), got "momentum"'),
        (
            "[lars]\n[optimizer]\nweight_decay = 1e-4",
            "optimizer.weight_decay=0.0001 with [lars] would decay twice; set it to 0 and use lars.lars_weight_decay",
        ),
        (
            "[lamb]\n[optimizer]\ntype = 'adamw'\nweight_decay = 0.01",
            "optimizer.weight_decay=0.01 with [lamb] would decay twice; set it to 0 and use lamb.lamb_weight_decay",
        ),
        (
            "[adaptive]\nlr = 'adascale'",
            'adaptive.lr = "adascale" supplies its own LR gain; set batch.scaling = "none"',
        ),
    ],
)
def test_validation_messages(text, expected):
    assert expected in error(text)


def test_combinations_that_are_allowed():
    # disabled LARS with adamw is fine; LAMB off and weight decay on is fine
    Strategy.from_toml("[lars]\nenable = false\n[optimizer]\ntype = 'adamw'\nweight_decay = 0.1")
    # AdaScale composes with LARS / LAMB when the static rule is off
    s = Strategy.from_toml(FLEET_LAMB + "[batch]\nscaling = 'none'\n[adaptive]\nlr = 'adascale'")
    assert s.lamb.enable and s.adaptive.lr == "adascale"


def test_from_dict_errors():
    assert "a strategy must be a table of sections, got list" in error([1])
    assert "unknown section [foo]" in error({"foo": {}})
    assert "`batch` must be a section: write [batch] with its keys (...), got 3" in error(
        {"batch": 3}
    )
    s = Strategy.from_dict(
        {"batch": {"global_batch_size": None}, "lamb": {"enable": False, "max_grad_norm": None}}
    )
    assert s.batch.global_batch_size is None and s.lamb.max_grad_norm is None
    assert "batch.base_lr: expected float, got NoneType None" in error({"batch": {"base_lr": None}})


# -- overrides -----------------------------------------------------------------------------


def test_with_overrides_literals():
    s = Strategy.from_toml(FLEET_LARS).with_overrides(
        [
            "lars.lars_coeff=0.002",
            "batch.global_batch_size = 4096",
            "batch.micro_batch_size=64",
            "amp.dtype=bfloat16",
            'batch.decay="poly"',
            "lars.exclude_from_weight_decay=['bn', 'bias']",
            "gradient_merge.avg=false",
        ]
    )
    assert s.lars.lars_coeff == 0.002 and s.batch.global_batch_size == 4096
    assert s.amp.enable and s.amp.dtype == "bfloat16"  # setting a key switches [amp] on
    assert s.batch.decay == "poly"
    assert s.lars.exclude_from_weight_decay == ("bn", "bias")
    assert s.gradient_merge.enable and not s.gradient_merge.avg
    assert s.resolve(4).k_steps == 16


def test_with_overrides_enable_and_none():
    s = Strategy.from_toml("[batch]\nglobal_batch_size = 512\n[amp]")
    off = s.with_overrides(["amp.enable=false", "amp.dtype=bfloat16"])
    assert not off.amp.enable and off.amp.dtype == "bfloat16"
    unset = s.with_overrides(["batch.global_batch_size=none", "batch.micro_batch_size=8"])
    assert unset.batch.global_batch_size is None and unset.resolve(2).global_batch_size == 16
    assert s.with_overrides([]) == s


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("lars.lars_coef=0.1", "unknown key lars.lars_coef; did you mean `lars_coeff`?"),
        ("lrs.lars_coeff=0.1", "unknown section [lrs]; did you mean `[lars]`?"),
        ("lars_coeff=0.1", "override 'lars_coeff=0.1' must look like section.key=value"),
        ("lars.lars_coeff", "override 'lars.lars_coeff' must look like section.key=value"),
        ("lars.lars_coeff=abc", "lars.lars_coeff: expected float, got str 'abc'"),
        ("batch.base_lr=none", "batch.base_lr: expected float, got str 'none'"),
        ("lars.lars_coeff=-1", "lars.lars_coeff must be > 0, got -1.0"),
        ("lamb.lamb_weight_decay=0.1", '[lamb] needs optimizer.type = "adamw"'),
    ],
)
def test_with_overrides_errors(override, expected):
    with pytest.raises(ConfigError) as info:
        Strategy().with_overrides([override])
    assert expected in str(info.value)


# -- batch arithmetic --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("toml", "world", "plan"),
    [
        # global + micro -> k (merge on, k unset)
        ("global_batch_size=4096\nmicro_batch_size=64\n[gradient_merge]", 8, (4096, 64, 8)),
        # global + k -> micro
        ("global_batch_size=4096\n[gradient_merge]\nk_steps=4", 8, (4096, 128, 4)),
        # micro + k -> global
        ("micro_batch_size=64\n[gradient_merge]\nk_steps=4", 2, (512, 64, 4)),
        # all three consistent
        (
            "global_batch_size=512\nmicro_batch_size=64\n[gradient_merge]\nk_steps=4",
            2,
            (512, 64, 4),
        ),
        # without merge k is 1
        ("global_batch_size=256", 2, (256, 128, 1)),
        ("micro_batch_size=32", 4, (128, 32, 1)),
        ("micro_batch_size=32\n[gradient_merge]", 4, (128, 32, 1)),
        # neither batch size: the base batch
        ("base_batch_size=128", 2, (128, 64, 1)),
        # a disabled merge section's k_steps is ignored
        ("micro_batch_size=32\n[gradient_merge]\nenable=false\nk_steps=4", 1, (32, 32, 1)),
    ],
)
def test_resolve_any_two_determine_the_third(toml, world, plan):
    p = Strategy.from_toml("[batch]\n" + toml).resolve(world)
    assert (p.global_batch_size, p.micro_batch_size, p.k_steps, p.world_size) == (*plan, world)
    assert p.global_batch_size == p.micro_batch_size * p.k_steps * p.world_size


@pytest.mark.parametrize(
    ("toml", "world", "expected"),
    [
        (
            "global_batch_size=1000\nmicro_batch_size=64\n[gradient_merge]\nk_steps=4",
            2,
            "batch.global_batch_size=1000 is not micro_batch_size 64 x k_steps 4 x world_size 2 = 512",
        ),
        (
            "global_batch_size=1024\nmicro_batch_size=64",
            2,
            "batch.global_batch_size=1024 is not micro_batch_size 64 x k_steps 1 x world_size 2 = 128; "
            "to merge 8 micro-steps add --set gradient_merge.k_steps=8 (in a file: "
            "[gradient_merge] k_steps = 8), or set batch.global_batch_size=128",
        ),
        (
            "global_batch_size=1000\nmicro_batch_size=64\n[gradient_merge]",
            2,
            "batch.global_batch_size=1000 is not a multiple of micro_batch_size 64 x world_size 2 = 128",
        ),
        (
            "global_batch_size=1000\n[gradient_merge]\nk_steps=4",
            4,
            "batch.global_batch_size=1000 is not divisible by k_steps 4 x world_size 4 = 16",
        ),
        (
            "global_batch_size=2",
            4,
            "batch.global_batch_size=2 is not divisible by k_steps 1 x world_size 4 = 4",
        ),
    ],
)
def test_resolve_errors_show_the_arithmetic(toml, world, expected):
    with pytest.raises(ConfigError) as info:
        Strategy.from_toml("[batch]\n" + toml).resolve(world)
    assert str(info.value) == expected


def test_resolve_scale_and_peak_lr():
    s = Strategy.from_toml("[batch]\nglobal_batch_size=4096\nbase_lr=0.1\nbase_batch_size=256")
    assert s.resolve(1).scale == 16.0 and s.resolve(1).peak_lr == pytest.approx(1.6)
    sq = s.with_overrides(["batch.scaling=sqrt"]).resolve(4)
    assert sq.peak_lr == pytest.approx(0.4)
    assert s.with_overrides(["batch.scaling=none"]).resolve(4).peak_lr == 0.1
    small = Strategy.from_toml("[batch]\nglobal_batch_size=64").resolve(1)
    assert small.scale == 0.25 and small.peak_lr == pytest.approx(0.025)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ConfigError, match="world_size must be an int >= 1"):
            s.resolve(bad)


# -- overview ------------------------------------------------------------------------------


def test_overview_fleet_style_with_derived_numbers():
    s = Strategy.from_toml(
        FLEET_LARS
        + "[batch]\nglobal_batch_size=4096\nmicro_batch_size=64\nwarmup_epochs=5\n[gradient_merge]"
    )
    text = s.overview(8, steps_per_epoch=312, total_steps=28080)
    lines = text.splitlines()
    assert all(len(line) == 80 for line in lines), [line for line in lines if len(line) != 80]
    assert "DistributedStrategy Overview" in lines[2]
    assert "lars=True <-> [lars]" in text and "gradient_merge=True <-> [gradient_merge]" in text
    assert "[amp]" not in text and "[lamb]" not in text and "[adaptive]" not in text
    rows = {line[1:37].strip(): line[41:-1].strip() for line in lines if line[1:37].strip()}
    assert rows["lars_coeff"] == "0.001" and rows["lars_weight_decay"] == "0.0005"
    # list items one per line, as Fleet prints them
    i = next(n for n, line in enumerate(lines)
             if "exclude_from_weight_decay" in line and "batch_norm" in line)
    assert "batch_norm" in lines[i] and lines[i + 1].strip("| ") == ".b_0"
    derived = text[text.index("derived (world_size=8)") :]
    assert "64 x 8 x 8" in derived
    assert "16 = 4096 / 256" in derived
    assert "1.6 = 0.1 x linear(16)" in derived
    assert "5 epochs = 1560 steps from 0.1" in derived
    assert "LARS" in derived and "28080" in derived


def test_overview_default_and_adaptive():
    text = Strategy().overview(1)
    assert "[batch]" in text and "[optimizer]" in text and "[data_parallel]" in text
    assert "0 steps" in text and "momentum" in text
    s = Strategy.from_toml("[adaptive]\nnoise_scale = true\n[recompute]\ncheckpoints=['a']")
    text = s.overview(2)
    assert "[adaptive]" in text and "recompute=True <-> [recompute]" in text
    assert RecomputeConfig(checkpoints=["a"]).checkpoints == ("a",)


def test_from_toml_path_forms(tmp_path, monkeypatch):
    f = tmp_path / "run.cfg"
    f.write_text(FLEET_LARS)
    assert Strategy.from_toml(f).lars.enable
    assert Strategy.from_toml(str(f)).lars.enable
    monkeypatch.chdir(tmp_path)
    assert Strategy.from_toml("run.cfg").lars.enable
    assert "cannot read strategy file nope.cfg" in error("nope.cfg")
    assert Strategy.from_toml("") == Strategy()
    assert Strategy.from_toml("batch.base_lr = 0.2").batch.base_lr == 0.2  # one-line TOML text


@pytest.mark.parametrize("toml, nesterov", [
    ("[lars]\nlars_coeff = 0.001", True),                         # LARS, unset: Nesterov
    ("[lars]\n[optimizer]\nnesterov = false", False),             # Fleet's heavy-ball, asked for
    ("[lars]\n[optimizer]\nmomentum = 0.0", False),               # no momentum, no Nesterov
    ("[lars]\n[kfac]", True),                                     # K-FAC before LARS
    ("[lars]\nenable = false", False),
    ("[optimizer]\nmomentum = 0.9", False),                       # plain SGD: torch's default
    ("[optimizer]\nnesterov = true", True),
])
def test_nesterov_unset_is_on_under_lars_only(toml, nesterov):
    s = Strategy.from_toml(toml)
    assert s.nesterov is nesterov
    again = Strategy.from_toml(s.to_toml())       # the run's strategy.toml keeps it unset
    assert again == s and again.nesterov is nesterov
    row = next(line for line in s.overview(1).splitlines() if " nesterov " in line)
    assert str(nesterov).lower() in row
    assert ("unset" in row) is ("nesterov" not in toml)
