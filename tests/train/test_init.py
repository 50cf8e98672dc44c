"""Depth-pruned teacher init: block influence, layer choice, weight copy, and the recipe wiring."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from distillgates.hf import to_hf
from distillgates.model import Transformer, load_model
from distillgates.train.init import block_influence, init_from_teacher, select_layers
from distillgates.train.recipe import train_student

from ..conftest import tiny_model_config


def test_block_influence_ranks_a_near_identity_block_last() -> None:
    teacher = Transformer(tiny_model_config(n_layers=3)).eval()
    with torch.no_grad():  # block 1 adds (almost) nothing to the residual stream
        teacher.layers[1].attn.o_proj.weight.mul_(1e-4)
        teacher.layers[1].mlp.down_proj.weight.mul_(1e-4)
    influence = block_influence(teacher, [torch.randint(0, 96, (2, 16)) for _ in range(2)])
    assert len(influence) == 3 and influence[1] < 1e-3 < min(influence[0], influence[2])
    assert select_layers(influence, 2) == [0, 2]
    assert not any(block._forward_hooks for block in teacher.layers)  # hooks removed


def test_select_layers_keeps_model_order_and_checks_count() -> None:
    assert select_layers([0.1, 0.9, 0.5, 0.7], 2) == [1, 3]
    with pytest.raises(ValueError, match="cannot keep 5"):
        select_layers([0.1, 0.2], 5)


def test_pruned_student_equals_teacher_with_blocks_removed() -> None:
    teacher = Transformer(tiny_model_config(n_layers=4)).eval()
    student = Transformer(tiny_model_config(n_layers=2)).eval()
    init_from_teacher(student, teacher, [0, 3])
    reference = Transformer(tiny_model_config(n_layers=4)).eval()
    reference.load_state_dict(teacher.state_dict())
    reference.layers = torch.nn.ModuleList([reference.layers[0], reference.layers[3]])
    ids = torch.randint(0, 96, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(student(ids), reference(ids))
    assert student.layers[0].attn.q_proj.weight.data_ptr() != teacher.layers[0].attn.q_proj.weight.data_ptr()


def test_width_mismatch_names_the_field() -> None:
    teacher = Transformer(tiny_model_config(n_layers=4))
    with pytest.raises(ValueError, match="d_model to equal the teacher's"):
        init_from_teacher(Transformer(tiny_model_config(d_model=48)), teacher, [0, 1])
    with pytest.raises(ValueError, match=r"init layers \[0, 7\]"):
        init_from_teacher(Transformer(tiny_model_config()), teacher, [0, 7])


def test_recipe_starts_from_the_teacher_and_records_the_choice(artifacts: dict[str, Any], tmp_path: Path) -> None:
    torch.set_num_threads(1)
    cfg = artifacts["make_config"](len(artifacts["tokenizer"]), steps=3, lr=1e-9, warmup_steps=1, init_from="teacher")
    teacher_cfg = dataclasses.replace(cfg.student, n_layers=3)
    torch.manual_seed(7)
    teacher = Transformer(teacher_cfg).eval()
    to_hf(teacher).save_pretrained(tmp_path / "teacher")
    artifacts["tokenizer"].save_pretrained(tmp_path / "teacher")  # a teacher directory holds its tokenizer
    from distillgates.config import TeacherConfig

    cfg.teacher = TeacherConfig(kind="local")
    path = train_student(cfg, "student", tmp_path, kd_path=artifacts["kd_path"], tokenizer=artifacts["tokenizer"],
                         train_items=artifacts["train"], eval_items=artifacts["eval"], progress=False, device="cpu")
    init = json.loads((tmp_path / "student" / "init.json").read_text())
    assert init["from"] == "teacher" and len(init["block_influence"]) == 3 and len(init["layers"]) == 2
    student = load_model(path)
    kept = teacher.layers[init["layers"][1]].mlp.up_proj.weight
    # lr 1e-9: three steps leave the copied weights where the teacher had them
    torch.testing.assert_close(student.layers[1].mlp.up_proj.weight, kept, atol=1e-5, rtol=0)


def test_init_from_a_teacher_with_another_tokenizer_is_refused(artifacts: dict[str, Any], tmp_path: Path) -> None:
    """The teacher's layers index its own vocabulary: a teacher with another one cannot start the student."""
    from distillgates.config import TeacherConfig
    from distillgates.tokenizer import train_tokenizer

    cfg = artifacts["make_config"](len(artifacts["tokenizer"]), steps=3, init_from="teacher")
    to_hf(Transformer(dataclasses.replace(cfg.student, n_layers=3))).save_pretrained(tmp_path / "teacher")
    other = train_tokenizer(["an unrelated corpus of words"] * 8, vocab_size=300, min_frequency=1)
    other.save_pretrained(tmp_path / "teacher")
    cfg.teacher = TeacherConfig(kind="local")
    with pytest.raises(ValueError, match=rf"train.init_from 'teacher' \({tmp_path / 'teacher'}\): the run's tokenizer "
                                         rf"\({len(artifacts['tokenizer'])} tokens\) does not match the checkpoint's "
                                         rf"\({len(other)} tokens\)"):  # fmt: skip
        train_student(cfg, "student", tmp_path, kd_path=artifacts["kd_path"], tokenizer=artifacts["tokenizer"],
                      train_items=artifacts["train"], eval_items=artifacts["eval"], progress=False, device="cpu")


def test_recipe_without_a_local_teacher_says_so(artifacts: dict[str, Any], tmp_path: Path) -> None:
    cfg = artifacts["make_config"](len(artifacts["tokenizer"]), steps=3, init_from="teacher")
    with pytest.raises(ValueError, match="needs a local teacher"):
        train_student(cfg, "student", tmp_path, kd_path=artifacts["kd_path"], tokenizer=artifacts["tokenizer"],
                      train_items=artifacts["train"], eval_items=artifacts["eval"], progress=False, device="cpu")


def _save_hf(family: str, path: Path, vocab: int, tokenizer: Any) -> Any:
    """A tiny random checkpoint with ``tokenizer`` saved beside it: Qwen2 (q/k/v biases) or Gemma 3 (a sliding layer
    with a window shorter than the rows, a global one, sandwich norms, q/k norm, scaled embeddings)."""
    import transformers

    torch.manual_seed(3)
    common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=32768, tie_word_embeddings=True)  # fmt: skip
    if family == "qwen2":
        hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    else:
        hf = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
            **common, head_dim=8, layer_types=["sliding_attention", "full_attention"], sliding_window=16,
            query_pre_attn_scalar=8))  # fmt: skip
    hf.eval().save_pretrained(path)
    tokenizer.save_pretrained(path)
    return hf


@pytest.mark.parametrize("family", ["qwen2", "gemma3_text"])
@pytest.mark.parametrize("role", ["student", "drafter"])
def test_recipe_starts_from_a_hf_checkpoint_and_saves_hf_format(
    artifacts: dict[str, Any], tmp_path: Path, role: str, family: str
) -> None:
    torch.set_num_threads(1)
    tok = artifacts["tokenizer"]
    hf = _save_hf(family, tmp_path / "ckpt", len(tok), tok)
    cfg = artifacts["make_config"](len(tok), steps=3, lr=1e-9, warmup_steps=1, init_from=f"hf:{tmp_path / 'ckpt'}")
    if role == "drafter":  # drafter_train.init_from, the student's train section untouched
        cfg.drafter_train, cfg.train = cfg.train, dataclasses.replace(cfg.train, init_from="scratch")
    else:
        cfg.student = None  # the checkpoint is the architecture
    path = train_student(cfg, role, tmp_path, kd_path=artifacts["kd_path"], tokenizer=tok,
                         train_items=artifacts["train"], eval_items=artifacts["eval"], progress=False, device="cpu")
    assert json.loads((tmp_path / role / "init.json").read_text()) == {"from": f"hf:{tmp_path / 'ckpt'}"}
    student = load_model(path)
    assert student.config.max_seq_len == max(cfg.shapes.lengths)  # not 32768
    if family == "qwen2":  # lr 1e-9: three steps leave the checkpoint's weights (biases included) where they were
        assert student.config.attention_bias
        torch.testing.assert_close(student.layers[1].attn.k_proj.bias, hf.model.layers[1].self_attn.k_proj.bias,
                                   atol=1e-5, rtol=0)  # fmt: skip
    else:
        assert student.config.gemma_features() and student.config.sliding_window == 16
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(tmp_path / role / "hf", local_files_only=True)
    assert saved.config.model_type == family
    ids = torch.randint(0, len(tok), (1, 40))  # longer than the Gemma checkpoint's window
    with torch.no_grad():
        torch.testing.assert_close(saved(ids).logits, student(ids), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(student(ids), hf(ids).logits, atol=1e-3, rtol=0)  # three steps at lr 1e-9


def test_hf_init_refuses_another_tokenizer_naming_both_sizes(artifacts: dict[str, Any], tmp_path: Path) -> None:
    from distillgates.tokenizer import train_tokenizer

    other = train_tokenizer(["an unrelated corpus of words"] * 8, vocab_size=300, min_frequency=1)
    _save_hf("qwen2", tmp_path / "qwen2", len(artifacts["tokenizer"]), other)
    cfg = artifacts["make_config"](len(artifacts["tokenizer"]), steps=3, init_from=f"hf:{tmp_path / 'qwen2'}")
    cfg.student = None
    with pytest.raises(ValueError, match=rf"the run's tokenizer \({len(artifacts['tokenizer'])} tokens\) does not "
                                         rf"match the checkpoint's \({len(other)} tokens\)"):  # fmt: skip
        train_student(cfg, "student", tmp_path, kd_path=artifacts["kd_path"], tokenizer=artifacts["tokenizer"],
                      train_items=artifacts["train"], eval_items=artifacts["eval"], progress=False, device="cpu")


def test_hf_init_refuses_a_model_section_that_disagrees(artifacts: dict[str, Any], tmp_path: Path) -> None:
    tok = artifacts["tokenizer"]
    from distillgates.hf import model_config_from_hf

    hf = _save_hf("qwen2", tmp_path / "qwen2", len(tok), tok)
    cfg = artifacts["make_config"](len(tok), steps=3, init_from=f"hf:{tmp_path / 'qwen2'}")
    cfg.student = dataclasses.replace(model_config_from_hf(hf.config, max(cfg.shapes.lengths)), n_layers=3)
    with pytest.raises(ValueError, match="the model section sets n_layers = 3, the checkpoint has 2"):
        train_student(cfg, "student", tmp_path, kd_path=artifacts["kd_path"], tokenizer=tok,
                      train_items=artifacts["train"], eval_items=artifacts["eval"], progress=False, device="cpu")


def test_init_from_must_name_a_checkpoint_dir() -> None:
    from distillgates.config import TrainConfig

    assert TrainConfig(init_from="hf:models/smollm").pretrained == Path("models/smollm")
    with pytest.raises(ValueError, match="scratch, teacher, hf:<checkpoint dir> or gguf:<file>, got 'hf:'"):
        TrainConfig(init_from="hf:")


def test_pruning_keeps_the_attention_kind_of_each_kept_layer() -> None:
    """A Gemma 3 teacher's sliding layers kept as full-attention layers would compute another model: the student
    takes the kept layers' kinds (kept_layer_types); a student section naming other kinds is refused, naming both."""
    from distillgates.train.init import kept_layer_types

    sliding = {"sliding_window": 3, "rope_local_theta": 100.0}
    teacher = Transformer(tiny_model_config(n_layers=3, layer_types=["sliding_attention", "full_attention",
                                                                     "sliding_attention"], **sliding))  # fmt: skip
    plain = tiny_model_config(n_layers=2, **sliding)
    assert kept_layer_types(plain, teacher.config, [0, 1]).layer_types == ["sliding_attention", "full_attention"]
    assert kept_layer_types(plain, teacher.config, [1, 1]).layer_types is None  # only global layers kept
    with pytest.raises(ValueError, match=r"kept layers \[0, 1\] are \['sliding_attention', 'full_attention'\], the "
                                         r"student's layer_types \['full_attention', 'sliding_attention'\]"):
        kept_layer_types(dataclasses.replace(plain, layer_types=["full_attention", "sliding_attention"]),
                         teacher.config, [0, 1])  # fmt: skip
    with pytest.raises(ValueError, match=r"built with layer_types all full, the kept layers \[0, 1\]"):
        init_from_teacher(Transformer(plain), teacher, [0, 1])
    student = Transformer(kept_layer_types(plain, teacher.config, [0, 2]))
    init_from_teacher(student, teacher, [0, 2])
    ids = torch.randint(0, 96, (1, 9))
    pruned = copy.deepcopy(teacher)
    del pruned.layers[1]
    pruned.config = student.config  # the teacher with its global layer removed computes what the student does
    torch.testing.assert_close(student(ids), pruned(ids))


def test_a_pruned_gemma_student_trains_and_resumes_with_the_kept_layer_types(artifacts: dict[str, Any],
                                                                           tmp_path: Path) -> None:
    """Through the recipe: a student section without layer_types, pruned from a teacher with sliding layers, is built
    with the kept layers' kinds, saved with them, and a resume rebuilds the same model from init.json."""
    from distillgates.config import TeacherConfig

    torch.set_num_threads(1)
    cfg = artifacts["make_config"](len(artifacts["tokenizer"]), steps=4, lr=1e-3, warmup_steps=1, init_from="teacher",
                                   ckpt_every=2)  # fmt: skip
    sliding = {"sliding_window": 8, "rope_local_theta": 100.0, "embed_scale": True, "sandwich_norm": True,
               "qk_norm": True, "activation": "gelu_tanh", "query_pre_attn_scalar": 8}  # Gemma 3 (gemma3_text in HF)
    cfg.student = dataclasses.replace(cfg.student, **sliding)
    types = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
    torch.manual_seed(7)
    teacher = Transformer(dataclasses.replace(cfg.student, n_layers=4, layer_types=types)).eval()
    to_hf(teacher).save_pretrained(tmp_path / "teacher")
    artifacts["tokenizer"].save_pretrained(tmp_path / "teacher")
    cfg.teacher = TeacherConfig(kind="local")
    kwargs = dict(kd_path=artifacts["kd_path"], tokenizer=artifacts["tokenizer"], train_items=artifacts["train"],
                  eval_items=artifacts["eval"], progress=False, device="cpu")
    train_student(cfg, "student", tmp_path, max_steps=2, **kwargs)  # type: ignore[arg-type]
    init = json.loads((tmp_path / "student" / "init.json").read_text())
    kept = [types[i] for i in init["layers"]]
    path = train_student(cfg, "student", tmp_path, **kwargs)  # type: ignore[arg-type]  # resumes at step 2
    assert load_model(path).config.layer_types == (kept if "sliding_attention" in kept else None)
