"""runtime.check_determinism: the combination TE cannot keep fused on sm_90 is refused in one
line; every other combination passes."""

from __future__ import annotations

import pytest
import torch

from errors import ConfigError
from runtime import check_determinism


def test_deterministic_documents_on_sm90_te_are_refused(monkeypatch):
    capability = {"value": (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: capability["value"])
    cuda = torch.device("cuda", 0)
    with pytest.raises(ConfigError) as e:
        check_determinism(True, "te", True, cuda)
    line = str(e.value)
    assert "\n" not in line and "train.deterministic=true" in line
    assert "data.document_mask=false" in line
    # Off, causal, the reference model, the CPU, or another architecture: accepted.
    check_determinism(False, "te", True, cuda)
    check_determinism(True, "te", False, cuda)
    check_determinism(True, "torch", True, cuda)
    check_determinism(True, "te", True, torch.device("cpu"))
    capability["value"] = (10, 0)
    check_determinism(True, "te", True, cuda)
