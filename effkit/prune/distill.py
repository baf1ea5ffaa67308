"""Knowledge distillation from the dense parent for the fine-tuning between pruning rounds.

A loss hook for the one training loop (`TrainHooks.loss`), not a second loop: the student's loss is
`(1 - alpha) * next-token cross-entropy + alpha * T^2 * KL(teacher_T || student_T)`, where `_T` means softmax at
temperature T over the vocabulary, at every position that has a next token (the positions the cross-entropy
uses), and the teacher is the frozen dense parent (eval mode, no gradients). T^2 keeps the KL term's gradients
on the cross-entropy's scale as T changes (Hinton et al., 2015).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from effkit.measure import evaluation


def kl_to_teacher(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Mean over positions of KL(teacher || student) at `temperature`, times temperature^2."""
    v = student_logits.size(-1)
    s = F.log_softmax(student_logits[:, :-1].reshape(-1, v).float() / temperature, dim=-1)
    t = F.log_softmax(teacher_logits[:, :-1].reshape(-1, v).float() / temperature, dim=-1)
    return F.kl_div(s, t, log_target=True, reduction="batchmean") * temperature ** 2


class Distiller:
    """The distillation loss hook: call it with (student logits, batch). It keeps the last step's parts
    (`last`: cross-entropy, KL, total) for reports and tests. The teacher is frozen in place (eval mode, no
    gradients), not copied: the prune stage's dense parent is never trained, and a copy would double its memory."""

    def __init__(self, teacher: nn.Module, alpha: float, temperature: float, teacher_name: str = ""):
        self.teacher = teacher.eval()
        for p in self.teacher.parameters():
            p.requires_grad_(False)
        self.alpha, self.temperature, self.teacher_name = alpha, temperature, teacher_name
        self.last: dict[str, float] = {}

    def __call__(self, logits: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
        ce = evaluation.lm_loss(logits, batch)
        with torch.no_grad():
            teacher_logits = self.teacher(batch).logits
        kl = kl_to_teacher(logits, teacher_logits, self.temperature)
        total = (1 - self.alpha) * ce + self.alpha * kl
        self.last = {"cross_entropy": ce.item(), "kl": kl.item(), "loss": total.item()}
        return total

    def describe(self) -> dict[str, Any]:
        return {"teacher": self.teacher_name, "alpha": self.alpha, "temperature": self.temperature,
                "loss": "(1 - alpha) * next-token cross-entropy + alpha * T^2 * KL(teacher_T || student_T), mean "
                        "over the positions with a next token; teacher frozen, eval mode"}
