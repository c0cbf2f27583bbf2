"""cuDNN's FP8 (e4m3) attention as a training baseline (issue 42; what TransformerEngine's ``fp8_dpa`` runs): an
autograd wrapper over the cuDNN frontend's ``sdpa_fp8`` forward and backward graphs with per-tensor delayed scaling,
and the callback behind ``pretrain_compare``'s ``sdpa=cudnn_fp8``. Benchmarks only; the frontend is a benchmark
dependency (``pip install nvidia-cudnn-frontend``), imported at the first call.

GPU smoke test (H200, torch 2.11, cuDNN frontend 1.32.0, 2x4x512x128 bf16 against float32 SDPA), relative L2 error:
non-causal O 0.0586, dQ 0.0711, dK 0.0708, dV 0.0593; causal O 0.0530, dQ 0.0687, dK 0.0682, dV 0.0552; the 3-step
training test through the callback passed. That is with the probabilities' scale fixed at 448: a delayed one from their
amax gave O an error of 0.54."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import Tensor
from torch.overrides import TorchFunctionMode

from sage_lightning.interception import bind_sdpa_arguments
from sage_lightning.layer import STATE_ATTRIBUTE

FP8_MAX = 448.0  # e4m3's largest finite value
#: The tensors with a scale: inputs, the output, the softmax probabilities (s), the score gradient (dp), gradients.
ROLES = ("q", "k", "v", "o", "s", "do", "dp", "dq", "dk", "dv")


class DelayedScaling:
    """Per-tensor FP8 scales as TransformerEngine's delayed scaling: ``fp8_max / max(history) / 2**margin`` over the
    last ``history_len`` amaxes of each role (the probabilities' ``s``: ``fp8_max / 2**margin``, P being at most 1).
    A call quantizes with the scales of earlier steps, then records its own amax; a role's first call takes its
    current amax. A non-finite amax is recorded as 0 (the step is lost, not the window), and a window of zeros keeps
    the previous scale. Pure torch, no host sync."""

    def __init__(self, history_len: int = 16, margin: int = 0) -> None:
        for name, value, low in (("history_len", history_len, 1), ("margin", margin, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"DelayedScaling: {name} must be an integer >= {low}; received {value!r}.")
        self.history_len, self.margin = history_len, margin
        self.history: dict[str, torch.Tensor] = {}
        self.scales: dict[str, torch.Tensor] = {}

    def primed(self, role: str) -> bool:  # whether ``role`` has an amax on record
        return role in self.history

    def update(self, role: str, amax: torch.Tensor) -> None:
        """Record one amax of ``role`` (a one-element tensor) and recompute its scale."""
        if role not in ROLES:
            raise ValueError(f"DelayedScaling: role must be one of {', '.join(ROLES)}; received {role!r}.")
        amax = amax.detach().float().reshape(1)
        amax = torch.where(torch.isfinite(amax), amax, torch.zeros_like(amax))
        past = self.history.get(role, torch.zeros(self.history_len, device=amax.device))
        self.history[role] = torch.cat([amax, past[:-1]])
        # P (role "s") is at most 1, so 448 P spans e4m3: a delayed scale from P's amax (2245 for 0.2) gave cuDNN's O
        # a relative L2 error of 0.54 on an H200 (device run 19), 448 gave 0.059.
        top = torch.ones_like(amax[0]) if role == "s" else self.history[role].max()
        self.scales[role] = torch.where(top > 0, FP8_MAX / top / 2**self.margin, self.scale(role, amax.device))

    def scale(self, role: str, device: torch.device | str) -> torch.Tensor:
        """The scale of ``role``, 0-d; before any amax, 448 for the probabilities (at most 1), else 1."""
        return self.scales.get(role, torch.full((), FP8_MAX if role == "s" else 1.0, device=device))


def frontend() -> Any:
    """The ``cudnn`` module of cuDNN's Python frontend; an ``ImportError`` saying how to install it where missing."""
    try:
        import cudnn
    except ImportError as error:
        why = "package nvidia-cudnn-frontend: `pip install nvidia-cudnn-frontend`"
        raise ImportError(f"sdpa=cudnn_fp8 needs cuDNN's Python frontend ({error}), {why}") from error
    return cudnn


def check_serves(head_dim: int, device: torch.device | str, heads: int = 1, kv_heads: int = 1) -> None:
    """Refuse what cuDNN's FP8 attention cannot serve (naming the argument and value), before any training."""
    device = torch.device(device)
    if heads != kv_heads:
        raise ValueError(f"sdpa=cudnn_fp8 takes as many key/value heads as query heads ({heads}); received {kv_heads}.")
    if device.type != "cuda":
        raise ValueError(f"sdpa=cudnn_fp8: cuDNN's FP8 attention runs on CUDA tensors; received device {device}.")
    if torch.cuda.get_device_capability(device)[0] == 9 and head_dim != 128:
        raise ValueError(f"sdpa=cudnn_fp8: cuDNN's FP8 attention on Hopper takes head dim 128; received {head_dim}.")
    frontend()


def _quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # Clamped: torch's e4m3 cast is not saturating (out of range gives NaN); delayed scales can be too large.
    # Contiguous: the graphs are built for one layout (a model's q, k, v are often transposed views).
    return (x.float() * scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8).contiguous()


def _dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (codes.view(torch.float8_e4m3fn).float() / scale).to(dtype)


_GRAPHS: dict[tuple, tuple[Any, Any]] = {}
# The graphs' inputs, in the order _execute takes their tensors; then their outputs (as "codes", "stats" or "amax").
_FORWARD = ("q", "k", "v", "descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")
_BACKWARD = ("q", "k", "v", "o", "dO", "stats", *(f"descale_{n}" for n in ("q", "k", "v", "o", "dO", "s", "dP")))
_BACKWARD += tuple(f"scale_{n}" for n in ("s", "dQ", "dK", "dV", "dP"))
_OUTPUTS = {"sdpa_fp8": ("codes", "stats", "amax", "amax"), "sdpa_fp8_backward": ("codes",) * 3 + ("amax",) * 4}


def _graphs(codes: torch.Tensor, causal: bool, attn_scale: float) -> tuple[Any, Any]:
    """``(forward, backward)``, each ``(graph, inputs, outputs, handle)``, for e4m3 codes shaped as ``codes``."""
    key = (tuple(codes.shape), codes.device.index, causal, attn_scale)
    if key not in _GRAPHS:
        cudnn = frontend()
        e4m3, f32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
        handle = cudnn.create_handle()  # one a shape: a few in a run
        like = {"codes": codes, "stats": torch.empty(*codes.shape[:3], 1, device=codes.device)}
        like["amax"] = torch.ones(1, 1, 1, 1, device=codes.device)
        built = []
        for op, names, extra in (("sdpa_fp8", _FORWARD, {"is_inference": False}), ("sdpa_fp8_backward", _BACKWARD, {})):
            g = cudnn.pygraph(io_data_type=e4m3, intermediate_data_type=f32, compute_data_type=f32, handle=handle)
            kinds = ["amax" if "scale" in n else "stats" if n == "stats" else "codes" for n in names]
            ins = {n: g.tensor_like(like[kind]) for n, kind in zip(names, kinds, strict=True)}
            for n, kind in zip(names, kinds, strict=True):
                ins[n].set_data_type(e4m3 if kind == "codes" else f32)
            outs = getattr(g, op)(**ins, **extra, attn_scale=attn_scale, use_causal_mask=causal)
            for out, kind in zip(outs, _OUTPUTS[op], strict=True):
                t = like[kind]
                out.set_output(True).set_dim(list(t.shape)).set_stride(list(t.stride()))
                out.set_data_type(e4m3 if kind == "codes" else f32)
            g.validate(), g.build_operation_graph(), g.create_execution_plans([cudnn.heur_mode.A])
            g.check_support(), g.build_plans()
            built.append((g, list(ins.values()), list(outs), handle))
        _GRAPHS[key] = (built[0], built[1])
    return _GRAPHS[key]


def _execute(graph: tuple, tensors: list[torch.Tensor], outputs: list[torch.Tensor]) -> None:
    g, ins, outs, handle = graph
    frontend().set_stream(handle, torch.cuda.current_stream(tensors[0].device).cuda_stream)
    pack = dict(zip(ins, [t.reshape(1, 1, 1, 1) if t.dim() == 0 else t for t in tensors], strict=True))
    pack.update(zip(outs, outputs, strict=True))
    workspace = torch.empty(g.get_workspace_size(), device=tensors[0].device, dtype=torch.uint8)
    g.execute(pack, workspace, handle=handle)


def scaled_call(
    scaling: DelayedScaling, amaxes: dict[str, torch.Tensor], produced: tuple[str, ...], run: Callable, record: bool
) -> tuple[Any, dict[str, torch.Tensor]]:
    """``run(scales) -> (results, amaxes of produced)`` with delayed scales. A produced role without history (the
    first step) takes the graph's own amax: ``run`` once to read it, then again with the scale it gives."""
    device = next(iter(amaxes.values())).device
    fresh = {r for r in (*amaxes, *produced) if not scaling.primed(r)}
    for role in fresh.intersection(amaxes):
        scaling.update(role, amaxes[role])
    roles = (*amaxes, *produced)
    scales = {r: scaling.scale(r, device) for r in roles}
    results, produced_amax = run(scales)
    if fresh.intersection(produced):
        for role in fresh.intersection(produced):
            scaling.update(role, produced_amax[role])
        scales = {r: scaling.scale(r, device) for r in roles}
        results, produced_amax = run(scales)
    if record:
        for role, amax in {**amaxes, **produced_amax}.items():
            if role not in fresh:
                scaling.update(role, amax)
    return results, scales


class _Fp8Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q, k, v, scaling: DelayedScaling, causal: bool, attn_scale: float, record: bool):
        def run(scales: dict[str, torch.Tensor]) -> tuple[Any, dict[str, torch.Tensor]]:
            codes = [_quantize(t, scales[r]) for r, t in zip("qkv", (q, k, v), strict=True)]
            o, stats = torch.empty_like(codes[0]), torch.empty(*q.shape[:3], 1, device=q.device)
            amax_s, amax_o = torch.empty(1, 1, 1, 1, device=q.device), torch.empty(1, 1, 1, 1, device=q.device)
            descales = [1 / scales[r] for r in ("q", "k", "v", "s")]
            graph = _graphs(codes[0], causal, attn_scale)[0]
            _execute(graph, [*codes, *descales, scales["s"], scales["o"]], [o, stats, amax_s, amax_o])
            return (codes, o, stats), {"s": amax_s, "o": amax_o}

        amaxes = {r: t.detach().abs().amax().float() for r, t in zip("qkv", (q, k, v), strict=True)}
        (codes, o, stats), scales = scaled_call(scaling, amaxes, ("o", "s"), run, record)
        ctx.save_for_backward(*codes, o, stats, *(scales[r] for r in ("q", "k", "v", "o", "s")))
        ctx.scaling, ctx.causal, ctx.attn_scale, ctx.dtype = scaling, causal, attn_scale, q.dtype
        return _dequantize(o, scales["o"], q.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        qc, kc, vc, oc, stats, sq, sk, sv, so, ss = ctx.saved_tensors

        def run(scales: dict[str, torch.Tensor]) -> tuple[Any, dict[str, torch.Tensor]]:
            grads = [torch.empty_like(qc) for _ in range(3)]
            amax = [torch.empty(1, 1, 1, 1, device=qc.device) for _ in range(4)]
            descales = [1 / s for s in (sq, sk, sv, so, scales["do"], ss, scales["dp"])]
            inputs = [qc, kc, vc, oc, _quantize(grad, scales["do"]), stats, *descales, ss]
            inputs += [scales[r] for r in ("dq", "dk", "dv", "dp")]
            _execute(_graphs(qc, ctx.causal, ctx.attn_scale)[1], inputs, [*grads, *amax])
            return grads, dict(zip(("dq", "dk", "dv", "dp"), amax, strict=True))

        amaxes = {"do": grad.detach().abs().amax().float()}
        grads, scales = scaled_call(ctx.scaling, amaxes, ("dp", "dq", "dk", "dv"), run, True)
        dq, dk, dv = (_dequantize(g, scales[r], ctx.dtype) for g, r in zip(grads, ("dq", "dk", "dv"), strict=True))
        return dq, dk, dv, None, None, None, None


def cudnn_fp8_attention(
    q: Tensor, k: Tensor, v: Tensor, *, scaling: DelayedScaling, is_causal: bool = False, scale: float | None = None
) -> Tensor:
    """``scaled_dot_product_attention(q, k, v, is_causal=..., scale=...)`` on cuDNN's FP8 graphs: ``[batch, heads,
    seq, head_dim]`` CUDA tensors, key and value shaped as the query; e4m3 codes in and out, dequantized to the
    query's dtype (bf16 in training). ``scaling`` holds the layer's amax history; a call without grad (validation)
    quantizes with it but records nothing."""
    tensors = (q, k, v)
    if not all(isinstance(t, torch.Tensor) and t.is_cuda and t.dim() == 4 and t.shape == q.shape for t in tensors):
        got = ", ".join(f"{tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) else repr(t) for t in tensors)
        raise ValueError(
            f"cudnn_fp8_attention: query, key and value must be CUDA tensors [batch, heads, seq, "
            f"head_dim] of one shape (no grouped heads); received {got}."
        )
    check_serves(q.shape[-1], q.device)
    attn_scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return _Fp8Attention.apply(q, k, v, scaling, bool(is_causal), attn_scale, torch.is_grad_enabled())


class _RouteSdpa(TorchFunctionMode):
    def __init__(self, scaling: DelayedScaling) -> None:
        super().__init__()
        self.scaling = scaling

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is not F.scaled_dot_product_attention:
            return func(*args, **(kwargs or {}))
        bound, problem = bind_sdpa_arguments(args, kwargs or {})
        if problem is None and (bound["attn_mask"] is not None or bound["dropout_p"]):
            problem = f"attn_mask or dropout_p={bound['dropout_p']} (served here: is_causal only)"
        if problem is not None:
            raise ValueError(f"sdpa=cudnn_fp8: a scaled_dot_product_attention call with {problem}.")
        q, k, v = bound["query"], bound["key"], bound["value"]
        return cudnn_fp8_attention(q, k, v, scaling=self.scaling, is_causal=bound["is_causal"], scale=bound["scale"])


class CudnnFp8Attention(Callback):
    """During fit, every swapped attention layer's SDPA calls (its mode ``"full"`` calls SDPA) run
    :func:`cudnn_fp8_attention`, each layer with its own :class:`DelayedScaling` (:attr:`scaling`, by module name):
    ``L.Trainer(callbacks=[CudnnFp8Attention()]).fit(LlamaPretraining(config, attention="full"), ...)``."""

    def __init__(self) -> None:
        self.scaling: dict[str, DelayedScaling] = {}
        self._hooks: list[Any] = []

    def on_fit_start(self, trainer: L.Trainer | None, pl_module: torch.nn.Module) -> None:
        # Here, not before fit: the mixin swaps the layers in configure_model.
        for name, module in pl_module.named_modules():
            if STATE_ATTRIBUTE in module.__dict__:
                mode = _RouteSdpa(self.scaling.setdefault(name, DelayedScaling()))

                def enter(module: Any, args: Any, mode: _RouteSdpa = mode) -> None:
                    mode.__enter__()

                def leave(module: Any, args: Any, output: Any, mode: _RouteSdpa = mode) -> None:
                    mode.__exit__(None, None, None)

                self._hooks += [module.register_forward_pre_hook(enter)]
                self._hooks += [module.register_forward_hook(leave, always_call=True)]
        if not self._hooks:
            raise ValueError("sdpa=cudnn_fp8: the model has no swapped attention layer (sage_lightning's) to route.")

    def teardown(self, trainer: L.Trainer | None, pl_module: torch.nn.Module, stage: str) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
