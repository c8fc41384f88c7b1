"""The Fleet keys bigbatch gained for `--fleet`, each by what it does: AMP's custom op
lists (CPU bfloat16), BatchNorm momentum under a merge, hybrid_configs' degrees,
"F-then-B", the Fleet file through the real CLI (its translation in the header, a wrong
process count and each key bigbatch cannot honour refused in one line, exit 2)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _cli import in_process
from torch import nn

from bigbatch.config.fleet import translate
from bigbatch.config.parallelism import degrees
from bigbatch.config.strategy import Strategy
from bigbatch.engine.bn_merge import merged_momentum
from bigbatch.engine.prepare import prepare
from bigbatch.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
OPTIMIZER = '[optimizer]\ntype = "Momentum"\nlearning_rate = 0.1\n'


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(torch.softmax(self.norm(self.fc(x)), -1))


def _dtypes(lists: dict) -> dict[str, torch.dtype]:
    """The output dtype of each layer (and of softmax) in one micro-step under [amp]."""
    torch.manual_seed(0)
    net = Net()
    strategy = Strategy.from_dict({"batch": {"global_batch_size": 4}, "amp": {
        "dtype": "bfloat16", **lists}})
    run = prepare(net, strategy, total_steps=1, nan_policy=None)
    seen = {}
    for name in ("fc", "norm", "head"):
        getattr(net, name).register_forward_hook(
            lambda m, i, o, name=name: seen.__setitem__(name, o.dtype))
    with run.micro_step() as ms:
        out = run.model(torch.randn(4, 4))
        seen["softmax"] = net.norm(net.fc(torch.randn(4, 4))).softmax(-1).dtype
        ms.backward(out.float().pow(2).mean())
    assert ms.stepped
    return seen


def test_amp_custom_lists_run_listed_ops_in_listed_dtype():
    plain = _dtypes({})
    assert plain["fc"] == plain["head"] == torch.bfloat16  # autocast's own choice
    lists = _dtypes({"custom_black_list": ["linear"],
                     "custom_white_list": ["layer_norm", "softmax"]})
    assert lists["fc"] == lists["head"] == torch.float32  # black: float32
    assert lists["norm"] == lists["softmax"] == torch.bfloat16  # white: low precision
    paddle = _dtypes({"custom_black_list": ["mul"]})  # Paddle's name of a matmul layer
    assert paddle["fc"] == torch.float32


def test_a_listed_op_casts_the_tensors_it_takes_by_keyword():
    """`F.layer_norm` passes weight= and bias= by keyword; a listed op casts those too
    (CUDA refuses a float16 input with a float32 weight; CPU kernels refuse some mixes)."""
    from bigbatch.engine.amp_lists import amp_context
    x, w, b = torch.randn(3, 4), torch.randn(5, 4), torch.randn(5)
    with amp_context("cpu", torch.bfloat16, white=["linear"]):
        out = torch.nn.functional.linear(x, w, bias=b)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, torch.nn.functional.linear(
        x.bfloat16(), w.bfloat16(), b.bfloat16()), rtol=0, atol=0)


def test_amp_lists_and_pure_fp16_from_fleet():
    t = translate("batch_size = 4\namp = true\n[amp_configs]\ncustom_white_list = "
                  '["softmax"]\ncustom_black_list = ["layer_norm"]\nuse_fp16_guard = false\n'
                  + OPTIMIZER)
    amp = t.build().amp
    assert (amp.custom_white_list, amp.custom_black_list) == (("softmax",), ("layer_norm",))
    assert amp.decr_ratio == 0.8  # Fleet's default, not bigbatch's 0.5
    assert any(k == "amp_configs.use_fp16_guard" for k, _ in t.rows)
    with pytest.raises(ConfigError, match="use_pure_fp16"):
        translate("batch_size = 4\namp = true\n[amp_configs]\nuse_pure_fp16 = true\n"
                  + OPTIMIZER)


@pytest.mark.parametrize("mode", ["merged", "per_micro_step"])
def test_bn_momentum_under_merge_follows_the_big_batch(mode):
    """k identical micro-batches: "merged" leaves the running mean where one update of
    the big batch at momentum 0.1 puts it; per micro-step it moves k times."""
    k, m = 4, 0.1
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 5), nn.BatchNorm1d(5, momentum=m))
    strategy = Strategy.from_dict({"batch": {"micro_batch_size": 8},
                                   "gradient_merge": {"k_steps": k, "bn_momentum": mode}})
    run = prepare(net, strategy, total_steps=1, nan_policy=None)
    x = torch.randn(8, 3)
    with torch.no_grad():
        batch_mean = net[0](x).mean(0)
    start = net[1].running_mean.clone()
    for _ in range(k):
        with run.micro_step() as ms:
            ms.backward(run.model(x).pow(2).mean())
    big = (1 - m) * start + m * batch_mean
    if mode == "merged":
        assert net[1].momentum == pytest.approx(merged_momentum(m, k))
        torch.testing.assert_close(net[1].running_mean, big, rtol=1e-5, atol=1e-6)
    else:
        assert not torch.allclose(net[1].running_mean, big, atol=1e-3)
    assert (1 - merged_momentum(m, k)) ** k == pytest.approx(1 - m)


def test_collective_meta_optimizers_are_left_out_of_a_parameter_server_job():
    """Fleet's LARS, LAMB, gradient merge, AMP and recompute apply in collective jobs only
    (their `_can_apply` checks `role_maker._is_collective`): under a_sync Fleet trains
    without them, and so does the translation, saying so line by line."""
    text = ("a_sync = true\nlars = true\ngradient_merge = true\namp = true\nbatch_size = 8\n"
            "[optimizer]\ntype = \"Momentum\"\nlearning_rate = 0.1\nmomentum = 0.9\n"
            "[gradient_merge_configs]\nk_steps = 4\n")
    t = translate(text)
    assert {"lars", "gradient_merge", "amp"}.isdisjoint(t.strategy)
    assert t.strategy["parameter_server"]["enable"]
    left = {key for key, said in t.rows if said.startswith("(not applied, as in Fleet")}
    assert left == {"lars", "gradient_merge", "amp"}
    collective = translate(text.replace("a_sync = true", "a_sync = false"))
    assert collective.strategy["lars"]["enable"] and collective.strategy["gradient_merge"][
        "k_steps"] == 4


def test_hybrid_configs_lay_out_fleet_degrees():
    t = translate("batch_size = 4\n[hybrid_configs]\ndp_degree = 2\nmp_degree = 2\n"
                  + OPTIMIZER)
    assert t.world_size == 4
    d = degrees(t.build(), 4)
    assert (d.data, d.tensor, d.pipeline) == (2, 2, 1)
    t = translate("batch_size = 4\n[hybrid_configs]\ndp_degree = 2\nsharding_degree = 2\n"
                  + OPTIMIZER)
    s = t.build()
    assert t.world_size == 4 and degrees(s, 4).data == 4  # Fleet's dp x sharding ranks
    assert s.sharding.enable and s.sharding.sharding_degree == 2 and s.sharding.stage == 1
    with pytest.raises(ConfigError, match="sharding.stage=1") as e:  # ZeRO-1 is DDP's
        translate("batch_size = 4\n[hybrid_configs]\nmp_degree = 2\nsharding_degree = 2\n"
                  + OPTIMIZER).build()
    assert "\n" not in str(e.value)
    p = translate("pipeline = true\n[hybrid_configs]\npp_degree = 2\n[pipeline_configs]\n"
                  'micro_batch_size = 2\naccumulate_steps = 4\nschedule_mode = "F-then-B"\n'
                  + OPTIMIZER).build()
    assert (p.pipeline.schedule_mode, p.pipeline.pp_degree) == ("GPipe", 2)
    assert degrees(p, 2).pipeline == 2 and p.resolve(1).k_steps == 4


def test_a_sync_k_steps_is_geo_and_tensor_init_seed_seeds_the_init():
    t = translate("batch_size = 4\na_sync = true\n[a_sync_configs]\nk_steps = 4\n" + OPTIMIZER)
    s = t.build()
    assert (s.parameter_server.enable, s.parameter_server.mode) == (True, "geo")
    assert s.parameter_server.geo_k_steps == 4
    assert "a_sync_configs.k_steps -> parameter_server.geo_k_steps = 4" in t.table()
    for k in (0, -1):  # Fleet's default -1 and 0: async
        s = translate(f"batch_size = 4\na_sync = true\n[a_sync_configs]\nk_steps = {k}\n"
                      + OPTIMIZER).build()
        assert s.parameter_server.mode == "async"
    t = translate("batch_size = 4\ntensor_parallel = true\n[tensor_parallel_configs]\n"
                  "tensor_parallel_degree = 2\ntensor_init_seed = 7\n" + OPTIMIZER)
    assert t.build().tensor_parallel.tensor_init_seed == 7
    assert ("tensor_parallel_configs.tensor_init_seed",
            "tensor_parallel.tensor_init_seed = 7") in t.rows
    t = translate("batch_size = 4\ntensor_parallel = true\n[tensor_parallel_configs]\n"
                  "tensor_parallel_degree = 2\ntensor_init_seed = -1\n" + OPTIMIZER)
    assert t.build().tensor_parallel.tensor_init_seed is None  # Fleet's unset: --seed


@pytest.mark.parametrize("text, named", [
    ("recompute = true\n[recompute_configs]\ncheckpoints = ['fc']\nenable_offload = true\n",
     "recompute_configs.enable_offload"),
    ("a_sync = true\n[a_sync_configs]\nk_steps = 2.5\n", "a_sync_configs.k_steps = 2.5"),
    ("tensor_parallel = true\n[tensor_parallel_configs]\ntensor_parallel_degree = 2\n"
     "tensor_init_seed = -3\n", "tensor_init_seed = -3"),
    ("heter_ccl_mode = true\n", "heter_ccl_mode"),
    ("half_async = true\n", "Fleet key half_async is not supported"),
    ("lamb = true\n", 'optimizer.type = "Adam"'),
])
def test_what_bigbatch_cannot_honour_is_refused_by_name(text, named):
    with pytest.raises(ConfigError) as e:
        translate("batch_size = 4\n" + text + OPTIMIZER).build()
    assert named in str(e.value) and "\n" not in str(e.value)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


def test_cli_header_shows_the_translation(tmp_path, cache, capsys):
    from bigbatch.cli.main import main

    args = ["train", "--fleet", str(ROOT / "examples/fleet/train_fleet_gradient_merge.toml"),
            "--task-opt", "num_samples=1000", "--model", "mlp", "--steps", "2", "--nproc", "1",
            "--no-progress", "--no-tensorboard", "--out", str(tmp_path / "run")]
    with in_process(cache):
        assert main(args) == 0
    out = capsys.readouterr()
    text = out.out + out.err
    assert "gradient_merge_configs.k_steps -> gradient_merge.k_steps = 4" in text
    assert "(Fleet scales no LR) -> batch.scaling = \"none\"" in text
    assert "32 x 4 x 1" in text and "at global batch 128" in text  # the merge grew it


def test_cli_refuses_in_one_line(tmp_path, cache, capsys):
    from bigbatch.cli.main import main

    bad = tmp_path / "offload.toml"
    bad.write_text("batch_size = 4\nrecompute = true\n[recompute_configs]\ncheckpoints = ['fc']\n"
                   "enable_offload = true\n" + OPTIMIZER)
    hybrid = tmp_path / "hybrid.toml"
    hybrid.write_text("batch_size = 4\n[hybrid_configs]\ndp_degree = 2\n" + OPTIMIZER)
    for path, named in ((bad, "recompute_configs.enable_offload"), (hybrid, "need 2 processes")):
        with in_process(cache):
            assert main(["train", "--fleet", str(path), "--nproc", "1",
                         "--out", str(tmp_path / "x")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and named in err, err
        assert not (tmp_path / "x").exists()
