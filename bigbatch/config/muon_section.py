"""``[muon]``: Muon for the hidden matrices, AdamW ([optimizer], type "adamw") for the rest.

Muon orthogonalises the momentum of each 2-D hidden weight by a Newton-Schulz iteration
(`bigbatch.optim.muon` has the update, the defaults and their sources). Embeddings, the
output head, norms and biases take the [optimizer]'s AdamW (its beta1, beta2, epsilon) in
the same optimizer, at the same learning rate: with scale_rule = "adamw" a Muon update's
RMS matches AdamW's, so an AdamW recipe's LR and weight decay carry over.
"""

from dataclasses import dataclass
from typing import ClassVar

from bigbatch.config.section_base import _f, _Section
from bigbatch.errors import ConfigError

__all__ = ["MuonConfig"]


@dataclass(frozen=True)
class MuonConfig(_Section):
    """``[muon]``: orthogonalised momentum for hidden matrices (Jordan et al. 2024; the
    update scale of Moonlight, Liu et al. 2025); AdamW takes the other parameters."""

    section: ClassVar[str] = "muon"

    enable: bool = _f(True)
    """Switch Muon on (a present [muon] section means true)."""
    momentum: float = _f(0.95, ge=0, lt=1)
    """Momentum of the Muon buffer, B = momentum * B + G (0.95: Jordan's and Moonlight's)."""
    nesterov: bool = _f(True)
    """Orthogonalise G + momentum * B (Nesterov) rather than B."""
    ns_steps: int = _f(5, ge=1, le=100)
    """Newton-Schulz iterations per step (5: both recipes)."""
    ns_coefficients: tuple[float, ...] = _f((3.4445, -4.7750, 2.0315))
    """The quintic's (a, b, c): X = a X + (b A + c A^2) X with A = X X^T (Jordan's values,
    which Moonlight keeps: singular values land in about [0.7, 1.2] after 5 steps)."""
    spread_ns: bool = _f(True)
    """Split the Newton-Schulz work of replicated matrices between the ranks that hold them
    (DDP's data ranks, the data replicas of tensor parallelism and of HSDP): each matrix is
    orthogonalised on one rank, balanced by cost, and one all-gather a step shares the
    results. false: every replica orthogonalises every matrix itself (no traffic for it)."""
    scale_rule: str = _f("adamw", choices=("adamw", "shape", "none"))
    """adamw: lr x update_rms x sqrt(max(rows, cols)) (Moonlight: AdamW's LR and weight decay
    carry over); shape: lr x sqrt(max(1, rows / cols)) (Jordan); none: lr."""
    update_rms: float = _f(0.2, gt=0, le=10)
    """The RMS a Muon update is scaled to under scale_rule = "adamw" (0.2: AdamW's typical)."""
    muon_weight_decay: float = _f(0.1, ge=0)
    """Decoupled weight decay, W *= 1 - lr x muon_weight_decay, on Muon's matrices and on
    AdamW's decayed tensors (replaces optimizer.weight_decay; 0.1: Moonlight's)."""
    adamw_params: tuple[str, ...] = _f(("embed", "head"))
    """Name substrings of matrices that AdamW takes instead of Muon (the embeddings and the
    output head); nn.Embedding weights, norms and biases (ndim <= 1) take AdamW anyway."""
    exclude_from_weight_decay: tuple[str, ...] | None = _f(None)
    """Parameter-name substrings with no weight decay. Unset: every tensor with ndim <= 1
    (biases, norm gains); [] decays everything."""

    def _check(self) -> None:
        if len(self.ns_coefficients) != 3:
            raise ConfigError(f"muon.ns_coefficients={list(self.ns_coefficients)!r} should be "
                              "three numbers [a, b, c], e.g. [3.4445, -4.775, 2.0315]")
