"""Core ML parity gates (macOS): Core ML prefill logits vs PyTorch, per enumerated shape."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.coreml_parity
@pytest.mark.requires_macos
def test_coreml_parity(gate, report, thresholds, shape):
    import coremltools as ct
    import numpy as np

    length = int(shape)
    model = report.run.load_model()
    ids = torch.randint(0, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(length))
    with torch.no_grad():
        eager = model(ids)[0, -1].double()  # (V,) logits of the last token
    mlmodel = ct.models.MLModel(str(report.run.require(report.run.export_dir / "prefill.mlpackage")))
    output = mlmodel.get_spec().description.output[0].name
    inputs = {"input_ids": ids.numpy().astype(np.int32), "length": np.array([length], dtype=np.int32)}
    coreml = torch.from_numpy(np.asarray(mlmodel.predict(inputs, state=mlmodel.make_state())[output])).double()
    cosine = torch.nn.functional.cosine_similarity(eager, coreml.reshape(-1), dim=0).item()
    gate.at_least(f"coreml.cosine[shape={shape}]", cosine, thresholds.coreml_cosine_min,
                  "cosine(Core ML prefill logits, PyTorch logits) on the last token")
