"""The cuDNN FP8 attention baseline (benchmarks.training.cudnn_fp8, issue 42): delayed scaling, the run option, the
matrix group and the routing on the CPU; the graphs themselves against float32 SDPA where CUDA and the frontend are."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from benchmarks.training import cudnn_fp8, evidence, matrix, pretrain_compare, runs, specs
from benchmarks.training.cudnn_fp8 import DelayedScaling
from examples.llama import LlamaConfig
from examples.pretrain import LlamaPretraining

REPO = Path(__file__).resolve().parent.parent


def _scales(scaling: DelayedScaling, *roles: str) -> list[float]:
    return [float(scaling.scale(role, "cpu")) for role in roles]


def test_the_scale_is_fp8_max_over_the_largest_amax_of_the_window() -> None:
    scaling = DelayedScaling(history_len=3)
    assert not scaling.primed("q") and _scales(scaling, "q", "s") == [1.0, 448.0]  # before any amax
    for amax, scale in ((2.0, 224.0), (1.0, 224.0), (4.0, 112.0), (1.0, 112.0), (1.0, 112.0), (1.0, 448.0)):
        scaling.update("q", torch.tensor(amax))
        assert scaling.primed("q") and _scales(scaling, "q") == [scale], amax
    assert scaling.history["q"].tolist() == [1.0, 1.0, 1.0]
    margin = DelayedScaling(margin=2)
    margin.update("dq", torch.tensor([[4.0]]))
    assert _scales(margin, "dq") == [448.0 / 4 / 4]


def test_the_probabilities_keep_the_fixed_scale_whatever_their_amax() -> None:
    # P is at most 1: 448 P spans e4m3. A delayed scale from P's amax (2245 for 0.2) gave O a rel L2 of 0.54 on an H200.
    scaling = DelayedScaling(history_len=2)
    for amax in (0.2, 1.0, 0.01, 0.0, float("inf"), float("nan"), 5.0):
        scaling.update("s", torch.tensor(amax))
        assert _scales(scaling, "s") == [448.0], amax
    assert scaling.primed("s") and scaling.history["s"].tolist() == [5.0, 0.0]  # the amaxes are still recorded
    margin = DelayedScaling(margin=1)
    margin.update("s", torch.tensor(0.2))
    assert _scales(margin, "s") == [224.0]


def test_zero_and_non_finite_amaxes_keep_the_previous_scale() -> None:
    scaling = DelayedScaling(history_len=2)
    scaling.update("o", torch.tensor(0.0))
    assert _scales(scaling, "o") == [1.0]  # nothing seen yet: the default stays
    scaling.update("o", torch.tensor(2.0))
    scaling.update("o", torch.tensor(float("inf")))
    assert _scales(scaling, "o") == [224.0]  # the inf is recorded as 0: the window still holds 2
    scaling.update("o", torch.tensor(float("nan")))
    assert _scales(scaling, "o") == [224.0] and scaling.history["o"].tolist() == [0.0, 0.0]
    scaling.update("o", torch.tensor(8.0))
    assert _scales(scaling, "o") == [56.0]


def test_bad_scaling_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="history_len must be an integer >= 1; received 0"):
        DelayedScaling(history_len=0)
    with pytest.raises(ValueError, match="margin must be an integer >= 0; received -1"):
        DelayedScaling(margin=-1)
    with pytest.raises(ValueError, match="role must be one of q, k, v, o, s, do, dp, dq, dk, dv; received 'x'"):
        DelayedScaling().update("x", torch.tensor(1.0))


def test_a_first_call_runs_again_with_the_scales_of_its_own_amaxes() -> None:
    scaling, calls = DelayedScaling(), []

    def run(scales: dict[str, torch.Tensor]) -> tuple[str, dict[str, torch.Tensor]]:
        calls.append({role: float(value) for role, value in scales.items()})
        return f"call {len(calls)}", {"o": torch.tensor(4.0 * len(calls))}

    results, scales = cudnn_fp8.scaled_call(scaling, {"q": torch.tensor(2.0)}, ("o",), run, record=True)
    # First step: q from its current amax; o from the graph's amax of a first run (4), then a second run.
    assert calls == [{"q": 224.0, "o": 1.0}, {"q": 224.0, "o": 112.0}] and results == "call 2"
    assert float(scales["o"]) == 112.0 and scaling.history["o"].tolist()[:2] == [4.0, 0.0]
    results, scales = cudnn_fp8.scaled_call(scaling, {"q": torch.tensor(7.0)}, ("o",), run, record=True)
    # Later steps: one run with the history's scales, then this step's amaxes are recorded.
    assert calls[2] == {"q": 224.0, "o": 112.0} and len(calls) == 3 and results == "call 3"
    assert _scales(scaling, "q", "o") == pytest.approx([64.0, 448.0 / 12])
    cudnn_fp8.scaled_call(scaling, {"q": torch.tensor(100.0)}, ("o",), run, record=False)  # validation
    assert _scales(scaling, "q", "o") == pytest.approx([64.0, 448.0 / 12])


def test_without_the_frontend_the_error_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cudnn", None)  # import cudnn raises ImportError
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    with pytest.raises(
        ImportError, match=r"Python frontend .*package nvidia-cudnn-frontend: `pip install nvidia-cudnn-frontend`"
    ):
        cudnn_fp8.frontend()
    with pytest.raises(ImportError, match="pip install nvidia-cudnn-frontend"):
        cudnn_fp8.check_serves(128, "cuda")


def test_what_cudnn_fp8_cannot_serve_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    with pytest.raises(ValueError, match="on Hopper takes head dim 128; received 64"):
        cudnn_fp8.check_serves(64, "cuda")
    with pytest.raises(ValueError, match=r"as many key/value heads as query heads \(10\); received 5"):
        cudnn_fp8.check_serves(128, "cuda", 10, 5)
    with pytest.raises(ValueError, match="runs on CUDA tensors; received device cpu"):
        cudnn_fp8.check_serves(128, "cpu")
    q = torch.randn(1, 2, 8, 128)
    with pytest.raises(ValueError, match=r"must be CUDA tensors .*; received \(1, 2, 8, 128\) on cpu, "):
        cudnn_fp8.cudnn_fp8_attention(q, q, q, scaling=DelayedScaling())
    with pytest.raises(ValueError, match=r"of one shape \(no grouped heads\); received .*\(1, 1, 8, 128\) on cpu"):
        cudnn_fp8.cudnn_fp8_attention(q, q[:, :1], q[:, :1], scaling=DelayedScaling())
    config = LlamaConfig(d_model=640, n_heads=10, n_kv_heads=5)
    with pytest.raises(ValueError, match="key/value heads"):
        runs.check_sdpa_backend("cudnn_fp8", config, 16, "cuda", torch.bfloat16)


def test_sdpa_cudnn_fp8_is_a_run_option_of_full_runs_only() -> None:
    spec = specs.parse_run("full:controller=off,seed=1235,sdpa=cudnn_fp8")
    assert (spec.attention, spec.seed, spec.sdpa_backend, spec.name) == (
        "full",
        1235,
        "cudnn_fp8",
        "full-seed1235-cudnn_fp8",
    )
    assert specs.parse_run("full:sdpa=cudnn_fp8,name=cudnn-fp8").name == "cudnn-fp8"
    with pytest.raises(ValueError, match="sdpa=cudnn_fp8 replaces full precision's SDPA: full runs only"):
        specs.parse_run("sage:sdpa=cudnn_fp8")
    with pytest.raises(ValueError, match="sdpa must be one of default, .*, cudnn_fp8; received 'fp8'"):
        specs.parse_run("full:sdpa=fp8")
    assert pretrain_compare.parse_args(["--sdpa-backend", "cudnn_fp8"]).sdpa_backend == "cudnn_fp8"
    assert [type(c) for c in runs.sdpa_callbacks("cudnn_fp8")] == [cudnn_fp8.CudnnFp8Attention]
    assert runs.sdpa_callbacks("cudnn") == runs.sdpa_callbacks(None) == []


def test_the_d128_group_trains_three_settings_with_two_seeds(tmp_path: Path) -> None:
    (group,) = matrix.baseline_groups(1234, 64, 2048)
    assert group.name == "large-qknorm-d128" and not group.speed
    assert [(r.name, r.attention, r.controller, r.seed, r.sdpa_backend) for r in group.runs] == [
        ("full", "full", False, None, None),
        ("sage-fixed", "sage", False, None, None),
        ("cudnn-fp8", "full", False, None, "cudnn_fp8"),
        ("full-seed1235", "full", False, 1235, None),
        ("sage-fixed-seed1235", "sage", False, 1235, None),
        ("cudnn-fp8-seed1235", "full", False, 1235, "cudnn_fp8"),
    ]
    config = specs.load_config(REPO / "examples/configs/small.yaml", group.changes)
    assert config["data"]["batch_size"] * config["data"]["seq_len"] == 131072
    shape = LlamaConfig(**config["model"]["config"])
    assert (shape.head_dim, shape.n_heads, shape.kv_heads, shape.qk_norm, shape.n_layers) == (128, 5, 5, True, 8)
    found = evidence.roles({"runs": [{"name": r.name, **r.__dict__} for r in group.runs]})
    assert (found["full"], found["full_seed_b"], found["cudnn_fp8"]) == ("full", "full-seed1235", "cudnn-fp8")
    # Not in the default matrix; --groups names it.
    assert group.name not in {g.name for g in matrix.evidence_groups(1234, 64, 8, 2048)}
    args = pretrain_compare.parse_args(["--matrix", "evidence", "--tokens-per-run", "1", "--groups", "nope"])
    args.out_dir = tmp_path
    with pytest.raises(SystemExit, match="among large-qknorm, .*, large-qknorm-d128; received 'nope'"):
        matrix.run_matrix(args, [])


def test_the_callback_routes_each_swapped_layer_with_its_own_scaling(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def fake(q, k, v, *, scaling, is_causal=False, scale=None):  # noqa: ANN001, ANN202
        calls.append((scaling, is_causal))
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=True)

    monkeypatch.setattr(cudnn_fp8, "cudnn_fp8_attention", fake)
    model = LlamaPretraining(LlamaConfig.from_name("tiny", n_layers=2, max_seq_len=32), attention="full")
    model.configure_model()
    callback = cudnn_fp8.CudnnFp8Attention()
    callback.on_fit_start(None, model)
    ids = torch.randint(0, model.config.vocab_size, (2, 16))
    model(ids).float().sum().backward()
    assert len(calls) == 2 and all(causal for _, causal in calls)
    assert {id(s) for s, _ in calls} == {id(s) for s in callback.scaling.values()} and len(callback.scaling) == 2
    callback.teardown(None, model, "fit")
    model(ids)
    assert len(calls) == 2  # no routing after teardown
    with pytest.raises(ValueError, match="no swapped attention layer"):
        cudnn_fp8.CudnnFp8Attention().on_fit_start(None, torch.nn.Linear(2, 2))


GPU = torch.cuda.is_available() and importlib.util.find_spec("cudnn") is not None


@pytest.mark.skipif(not GPU, reason="needs CUDA and cuDNN's frontend (pip install nvidia-cudnn-frontend)")
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_forward_and_backward_match_float32_sdpa(causal: bool) -> None:
    torch.manual_seed(0)
    scaling = DelayedScaling()
    # [batch, heads, seq, head_dim] views of [batch, seq, heads, head_dim], as a model's projections give them.
    q, k, v = (torch.randn(2, 512, 4, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(3))
    grad = torch.randn_like(q)
    ref = [t.float().requires_grad_(True) for t in (q, k, v)]
    F.scaled_dot_product_attention(*ref, is_causal=causal).backward(grad.float())
    expected = [F.scaled_dot_product_attention(*[t.detach() for t in ref], is_causal=causal)] + [t.grad for t in ref]
    for step in range(3):  # the first step primes the scales; later ones use the history
        inputs = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = cudnn_fp8.cudnn_fp8_attention(*inputs, scaling=scaling, is_causal=causal)
        out.backward(grad)
        for name, got, want in zip(("O", "dQ", "dK", "dV"), [out] + [t.grad for t in inputs], expected, strict=True):
            assert got.dtype == torch.bfloat16 and torch.isfinite(got).all(), (step, name)
            error = ((got.float() - want).norm() / want.norm()).item()
            print(f"step {step} causal={causal} {name} rel_l2 {error:.4f}")
            assert error < 0.15, (step, name, error)  # H200: 0.053 to 0.071
    assert all(scaling.primed(role) for role in cudnn_fp8.ROLES)


@pytest.mark.skipif(not GPU, reason="needs CUDA and cuDNN's frontend (pip install nvidia-cudnn-frontend)")
def test_gpu_a_model_trains_through_the_callback() -> None:
    torch.manual_seed(0)
    config = LlamaConfig.from_name("tiny", n_layers=2, d_model=256, n_heads=2, n_kv_heads=2, max_seq_len=256)
    model = LlamaPretraining(config, attention="full").cuda()
    model.configure_model()
    callback = cudnn_fp8.CudnnFp8Attention()
    callback.on_fit_start(None, model)
    ids = torch.randint(0, config.vocab_size, (2, 256), device="cuda")
    for _ in range(3):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(ids[:, :-1]).float().flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        assert torch.isfinite(loss), loss
    assert len(callback.scaling) == 2
    assert all(s.primed(role) for s in callback.scaling.values() for role in cudnn_fp8.ROLES)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
