"""Built-in tasks: data, cache, models, loss counts, registry errors, a few training steps."""

import math
import random

import numpy as np
import pytest
import torch
from torch import nn

from bigbatch.errors import ConfigError
from bigbatch.tasks import TASKS, Recipe, get_task
from bigbatch.tasks import mnist1d as m1d
from bigbatch.tasks.charlm import IGNORE_INDEX

N = 200  # tiny MNIST-1D: generation takes a fraction of a second


@pytest.fixture(autouse=True)
def one_thread():
    # Tiny ops gain nothing from threads, and on a shared 2-core box they oversubscribe.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path / "bigbatch"


@pytest.fixture
def mnist(cache):
    return get_task("mnist1d", num_samples=N, seed=1)


@pytest.fixture(scope="module")
def charlm():
    return get_task("charlm", seq_len=32, d_model=32, n_layer=1, n_head=2)


def test_mnist1d_shapes_and_dtypes(mnist):
    x, y = mnist.train_set.tensors
    xt, yt = mnist.test_set.tensors
    assert x.shape == (160, 40) and xt.shape == (40, 40)
    assert x.dtype == torch.float32 and y.dtype == torch.int64
    assert y.min() >= 0 and y.max() < 10 and len(set(y.tolist())) == 10


def test_mnist1d_deterministic_by_seed(cache, tmp_path):
    a = get_task("mnist1d", num_samples=N, seed=1)
    b = get_task("mnist1d", num_samples=N, seed=1, cache_dir=tmp_path / "other")
    c = get_task("mnist1d", num_samples=N, seed=2)
    assert a.generated and b.generated  # two independent generations ...
    assert torch.equal(a.train_set.tensors[0], b.train_set.tensors[0])  # ... agree
    assert not torch.equal(a.train_set.tensors[0], c.train_set.tensors[0])


def test_mnist1d_cache_hit_does_not_regenerate(cache, monkeypatch):
    first = get_task("mnist1d", num_samples=N, seed=3)
    assert first.generated and first.cache_path.parent == cache
    assert first.cache_path.name.startswith("mnist1d-") and first.cache_path.suffix == ".pt"
    assert not list(cache.glob(".*tmp"))  # atomic write left no temporary behind

    def boom(*a, **k):
        raise AssertionError("regenerated despite a cache hit")

    monkeypatch.setattr(m1d, "_generate", boom)
    second = get_task("mnist1d", num_samples=N, seed=3)
    assert not second.generated
    assert torch.equal(first.test_set.tensors[0], second.test_set.tensors[0])
    with pytest.raises(AssertionError):  # other parameters -> other key -> generation
        get_task("mnist1d", num_samples=N + 10, seed=3)


def test_mnist1d_corrupt_cache_is_regenerated(cache):
    first = get_task("mnist1d", num_samples=N, seed=4)
    first.cache_path.write_bytes(b"not a torch file")
    again = get_task("mnist1d", num_samples=N, seed=4)
    assert again.generated
    assert torch.equal(first.train_set.tensors[1], again.train_set.tensors[1])


def test_mnist1d_generation_leaves_global_rngs_alone(cache):
    np.random.seed(123)
    random.seed(123)
    get_task("mnist1d", num_samples=N, seed=5)
    a, b = np.random.rand(), random.random()
    np.random.seed(123)
    random.seed(123)
    assert (a, b) == (np.random.rand(), random.random())


@pytest.mark.parametrize("model", ["cnn", "mlp"])
def test_mnist1d_models(mnist, model):
    torch.manual_seed(0)
    net = mnist.build_model(model)
    x, y = mnist.train_set[:7]
    assert net(x).shape == (7, 10)
    has_bn = any(isinstance(m, nn.BatchNorm1d) for m in net.modules())
    assert has_bn == (model == "cnn")
    assert 10_000 < sum(p.numel() for p in net.parameters()) < 150_000
    assert isinstance(mnist.recipe(model), Recipe)


def test_registry_errors(mnist):
    with pytest.raises(ConfigError, match=r"task='nope'.*mnist1d, charlm"):
        get_task("nope")
    with pytest.raises(ConfigError, match=r"model='resnet'.*cnn, mlp"):
        mnist.build_model("resnet")
    with pytest.raises(ConfigError, match=r"model='resnet'"):
        mnist.recipe("resnet")
    with pytest.raises(ConfigError, match=r"'num_sample'.*num_samples"):
        get_task("mnist1d", num_sample=5)
    with pytest.raises(ConfigError, match="num_samples"):
        get_task("mnist1d", num_samples=3)
    assert set(TASKS) == {"mnist1d", "charlm"}


def _train(task, model, steps, lr, opt="sgd", bs=32):
    x, y = task.train_set.tensors
    g = torch.Generator().manual_seed(0)
    if opt == "sgd":
        optim = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    else:
        optim = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        idx = torch.randint(len(x), (bs,), generator=g)
        batch = (x[idx], y[idx])
        loss_sum, count = task.loss(model(batch[0]), batch)
        optim.zero_grad()
        (loss_sum / count).backward()
        optim.step()
        losses.append(loss_sum.item() / count)
    return losses


def test_mnist1d_training_reduces_loss_and_evaluates(mnist):
    torch.manual_seed(0)
    net = mnist.build_model("cnn")
    # Evaluated on training data: 160 samples teach little about the test split.
    loader = [mnist.train_set[i : i + 16] for i in range(0, len(mnist.train_set), 16)]
    before = mnist.evaluate(net, loader)
    losses = _train(mnist, net, 30, 0.05)
    after = mnist.evaluate(net, loader)
    assert np.mean(losses[-5:]) < np.mean(losses[:5])
    assert after["loss"] < before["loss"] and 0.0 <= after["accuracy"] <= 1.0
    assert net.training  # evaluate restores the mode
    doubled = mnist.evaluate(net, loader, reduce=lambda t: 2 * t)  # a 2-worker all-reduce
    assert doubled == pytest.approx(after)


def test_charlm_data(charlm):
    x, y = charlm.train_set.tensors
    assert x.shape[1] == 32 and x.dtype == torch.int64 and y.shape == x.shape
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are inputs shifted by one
    assert torch.equal(y[:-1, -1], x[1:, 0])  # windows tile the text
    n_train = x.numel()
    n_test = charlm.test_set.tensors[0].numel()
    assert 0.08 < n_test / (n_train + n_test) < 0.12
    assert charlm.vocab_size == len(charlm.chars) > 60
    assert charlm.decode(x[0].tolist()) in charlm_text()
    again = get_task("charlm", seq_len=32)
    assert torch.equal(again.train_set.tensors[0], x)


def charlm_text():
    from bigbatch.tasks.charlm import corpus

    return corpus()


def test_charlm_model_names_and_shapes(charlm):
    torch.manual_seed(0)
    net = charlm.build_model()
    x, _ = charlm.train_set[:3]
    assert net(x).shape == (3, 32, charlm.vocab_size)
    names = dict(net.named_parameters())
    for mod_name, mod in net.named_modules():
        for p_name, _ in mod.named_parameters(recurse=False):
            full = f"{mod_name}.{p_name}"
            if isinstance(mod, nn.LayerNorm):
                assert "norm" in full, full
            if p_name == "bias":
                assert "bias" in full
    assert "head.weight" not in names  # tied to the token embedding
    with pytest.raises(ConfigError, match=r"model='cnn'.*transformer"):
        charlm.build_model("cnn")


def test_charlm_variable_length_counts_real_tokens_only():
    task = get_task("charlm", seq_len=32, variable_length=True, min_length=4, seed=7,
                    d_model=32, n_layer=1, n_head=2)
    x, y = task.train_set[:8]
    real = y != IGNORE_INDEX
    lengths = real.sum(1)
    assert lengths.min() >= 4 and lengths.max() <= 32 and len(set(lengths.tolist())) > 1
    assert torch.all(real[:, :-1] >= real[:, 1:])  # padding only at the end
    assert torch.all(x[~real] == 0)
    torch.manual_seed(0)
    net = task.build_model()
    loss_sum, count = task.loss(net(x), (x, y))
    assert count == int(lengths.sum())
    # Same total as each sequence cut to its real length: padding neither counts nor leaks.
    ref = sum(
        task.loss(net(x[i : i + 1, :n]), (x[i : i + 1, :n], y[i : i + 1, :n]))[0]
        for i, n in enumerate(lengths.tolist())
    )
    torch.testing.assert_close(loss_sum, ref, rtol=1e-5, atol=1e-4)
    full = get_task("charlm", seq_len=32, variable_length=True, min_length=4, seed=8)
    assert not torch.equal(full.train_set.tensors[1], task.train_set.tensors[1])
    assert full.test_set.tensors[1].min() >= 0  # evaluation windows are always full


def test_charlm_training_reduces_loss(charlm):
    torch.manual_seed(0)
    net = charlm.build_model()
    loader = [charlm.test_set[i : i + 64] for i in range(0, 256, 64)]
    before = charlm.evaluate(net, loader)
    assert before["loss"] == pytest.approx(math.log(charlm.vocab_size), rel=0.1)
    _train(charlm, net, 30, 3e-3, opt="adamw", bs=16)
    after = charlm.evaluate(net, loader)
    assert after["loss"] < before["loss"] - 0.5
    assert after["bpc"] == pytest.approx(after["loss"] / math.log(2))


def test_charlm_bad_options():
    with pytest.raises(ConfigError, match="min_length"):
        get_task("charlm", seq_len=16, variable_length=True, min_length=17)
    with pytest.raises(ConfigError, match="n_head"):
        get_task("charlm", d_model=30, n_head=4).build_model()


def test_references_apply_to_default_options_only(mnist):
    assert not mnist.default_options  # num_samples=200: the measured baselines do not apply
    lm = get_task("charlm", seq_len=64)
    assert lm.default_options and lm.recipe().reference is not None
    assert not get_task("charlm", seq_len=32).default_options
