import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from effkit.model import build_model, load_model, save_model
from effkit.model.convert import hf_state_dict


def test_conv1d_layers_become_linear():
    m = build_model("gpt2-nano", vocab_size=300)
    attn = m.transformer.h[0].attn
    assert isinstance(attn.c_attn, nn.Linear) and attn.c_attn.weight.shape == (3 * 64, 64)
    assert isinstance(m.transformer.h[0].mlp.c_fc, nn.Linear)
    assert m.transformer.h[0].mlp.c_fc.weight.shape == (256, 64)
    assert m.config._attn_implementation == "sdpa"


def test_saved_model_loads_in_plain_transformers_with_equal_logits(tmp_path):
    torch.manual_seed(0)
    m = build_model("gpt2-nano", vocab_size=300).eval()
    with torch.no_grad():  # make c_proj (square) asymmetric so a missing transpose would show
        m.transformer.h[0].attn.c_proj.weight.add_(torch.randn(64, 64))
    x = torch.randint(0, 300, (2, 24))
    with torch.no_grad():
        ref = m(x).logits
    save_model(m, tmp_path)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(plain.transformer.h[0].attn.c_attn).__name__ == "Conv1D"
    with torch.no_grad():
        assert torch.allclose(plain(x).logits, ref, atol=1e-5)
        assert torch.allclose(load_model(str(tmp_path)).eval()(x).logits, ref, atol=1e-5)


def test_hf_state_dict_transposes_only_block_projections():
    sd = {"transformer.h.0.attn.c_attn.weight": torch.zeros(6, 2), "transformer.h.0.attn.c_attn.bias": torch.zeros(6),
          "transformer.wte.weight": torch.zeros(5, 2), "lm_head.weight": torch.zeros(5, 2)}
    out = hf_state_dict(sd)
    assert out["transformer.h.0.attn.c_attn.weight"].shape == (2, 6)
    assert out["transformer.wte.weight"].shape == (5, 2) and out["transformer.h.0.attn.c_attn.bias"].shape == (6,)


def test_trained_artifact_is_a_complete_hf_folder(tiny_cfg):
    from effkit.train import train

    report = train(tiny_cfg(max_steps=2), progress=False)
    path = report["artifact"]
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    ids = tok("The Congress", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=tok.eos_token_id)
    assert out.shape == (1, ids.shape[1] + 5)
