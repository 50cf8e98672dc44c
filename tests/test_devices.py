"""The config's ``device`` and the autocast there: auto takes what torch sees; a named device torch does not see
is an error, never a silent CPU run. (This machine has only a CPU: the cuda/mps paths run where they exist.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from distillgates.config import Config, load_config
from distillgates.devices import autocast_dtype, resolve_device
from distillgates.pipeline import preflight


@pytest.mark.skipif(torch.cuda.is_available() or torch.backends.mps.is_available(), reason="a machine with a GPU")
def test_auto_is_the_cpu_here_and_a_missing_gpu_is_an_error() -> None:
    assert resolve_device("auto") == "cpu" and resolve_device("cpu") == "cpu"
    with pytest.raises(ValueError, match=r"device: 'cuda:1', but torch .* sees 0 CUDA device\(s\); use auto or cpu"):
        resolve_device("cuda:1")
    with pytest.raises(ValueError, match=r"device: 'mps', but torch .* sees no MPS device"):
        resolve_device("mps")
    with pytest.raises(ValueError, match=r"^device: device: 'cuda'"):
        preflight(Config(device="cuda"))


def test_autocast_is_bf16_only_where_native_or_asked_for() -> None:
    assert autocast_dtype("cpu", "auto") is None and autocast_dtype("cpu", "no") is None
    assert autocast_dtype("cpu", "bf16") is torch.bfloat16 and autocast_dtype("cpu", "fp16") is None
    assert autocast_dtype("cuda", "fp16") is torch.float16


def test_the_config_names_the_device_setting(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("device: gpu\n")
    with pytest.raises(ValueError, match="device must be auto, cpu, cuda, cuda:<n> or mps, got 'gpu'"):
        load_config(path)
    assert Config().device == "auto"
