"""Builds `tests/fixtures/dense_vl/mtp_reference.npz`: MTP draft logits from transformers (dev tier).

    pip install -e '.[dev]' && python scripts/make_mtp_reference.py

`scripts/make_reference.py` calls it too, after it rewrites `dense_vl`. The reference is
transformers' generic MTP module (`MtpModel` / `MtpLayer` in `transformers/modeling_layers.py`),
run on the `mtp.*` weights of the `dense_vl` checkpoint, on top of `Qwen3_5ForConditionalGeneration`
in fp32. The file holds, for BATCH rows of SEQ_LEN random token ids (seed SEED):

- `token_ids` [B, T] int32;
- `hidden` [B, T, H] fp32: the main model's final-normed hidden states h_t;
- `draft_logits` [B, T-1, V] fp32: row t combines (h_t, tok_{t+1}) and predicts tok_{t+2}.

Loading. `MtpModel.from_pretrained(main_model)` with the official name mapping
(`conversion_mapping.py`, entry "MtpModel": the `mtp.` prefix dropped, `fc` -> `layers.0.eh_proj`,
`pre_fc_norm_embedding` -> `layers.0.enorm`, `pre_fc_norm_hidden` -> `layers.0.hnorm`, `norm` ->
`layers.0.post_norm`, `layers.0.*` -> `layers.0.mtp_block.*`). transformers' `Qwen3_5TextConfig`
declares neither field that the generic module needs, so they are set on the loaded config:
`num_mtp_layers` (the number of `mtp.layers.N` in the checkpoint; this fixture's config has no
`mtp_num_hidden_layers`) and `mtp_layer_types = ["full_attention"]`. Every loaded MTP tensor is
checked against its tensor in `model-mtp.safetensors`, so a wrong mapping cannot pass unseen.

What transformers computes, read from its code (5.24.0), against DESIGN §14 and our `mtp_step`:

- concat order: `[enorm(embed(tok_{t+1})), hnorm(h_t)]`, embedding first (`MtpLayer.forward`,
  unless the config sets `mtp_hidden_states_first`, which Qwen3.5 does not). Same as ours.
- h_t: `MTPCandidateGenerator` feeds `hidden_states[-1]`, which `capture_outputs` ties to
  `last_hidden_state`, the output of the main model's final norm. Same as ours.
- norms: `enorm` = `pre_fc_norm_embedding`, `hnorm` = `pre_fc_norm_hidden`, both the model's
  zero-centred RMSNorm (`x * (1 + w)`); `post_norm` = `mtp.norm`, applied after the decoder
  layer and before the shared `lm_head`. Same as ours.
- RoPE position: transformers rotates row t with position t + 1, the position of tok_{t+1}
  (`MtpModel.forward`: "shifted by 1 from the main model"; `MtpCache` offsets queries by
  depth + 1). Ours rotates it with t, the position of h_t (as vLLM's MTP proposer does). Only the
  differences of positions enter the attention scores, so the logits agree; this script
  computes both and checks they do (max difference about 1e-6 in fp32). The stored reference
  uses transformers' own convention.
"""

from __future__ import annotations

import pathlib
import re

import numpy as np
import torch
from safetensors.numpy import load_file
from transformers import Qwen3_5ForConditionalGeneration
from transformers.cache_utils import MtpCache
from transformers.modeling_layers import MtpModel

FIXTURE = pathlib.Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "dense_vl"
BATCH, SEQ_LEN, SEED = 2, 16, 8
# The checkpoint's name (after `mtp.`) of each tensor of the generic MtpModel.
NAMES = {"layers.0.eh_proj.weight": "fc.weight",
         "layers.0.enorm.weight": "pre_fc_norm_embedding.weight",
         "layers.0.hnorm.weight": "pre_fc_norm_hidden.weight",
         "layers.0.post_norm.weight": "norm.weight"}


def load(path: pathlib.Path = FIXTURE) -> tuple[torch.nn.Module, MtpModel]:
    """(main model, MtpModel) in fp32 from the checkpoint at `path`, through the official loader."""
    main = Qwen3_5ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    mtp_file = load_file(str(path / "model-mtp.safetensors"))
    text = main.config.text_config
    text.num_mtp_layers = len({m.group(1) for k in mtp_file
                               if (m := re.match(r"mtp\.layers\.(\d+)\.", k))})
    text.mtp_layer_types = ["full_attention"] * text.num_mtp_layers
    mtp = MtpModel.from_pretrained(main).eval()
    loaded = {k: v for k, v in mtp.state_dict().items()
              if not k.startswith(("embed_tokens.", "shared_head."))}
    for name, tensor in loaded.items():
        stored = NAMES.get(name, name.replace(".mtp_block.", ".", 1))
        np.testing.assert_array_equal(tensor.numpy(), mtp_file.pop(f"mtp.{stored}"), err_msg=name)
    assert not mtp_file, f"checkpoint MTP tensors the module did not load: {sorted(mtp_file)}"
    return main, mtp


def _draft(main, mtp: MtpModel, hidden: torch.Tensor, token_ids: torch.Tensor,
           first_pos: int) -> torch.Tensor:
    """Draft logits of every row (h_t, tok_{t+1}), row t rotated with position t + first_pos."""
    t = token_ids.shape[1] - 1
    positions = (torch.arange(t) + first_pos)[None].expand(token_ids.shape[0], -1)
    out = mtp.forward_layer(0, hidden[:, :-1], positions,
                            MtpCache(config=main.config.get_mtp_config()),
                            input_ids=token_ids[:, 1:])
    return mtp._project_to_logits(out)


def mtp_reference(path: pathlib.Path = FIXTURE) -> dict[str, np.ndarray]:
    """The arrays of `mtp_reference.npz`, computed from the checkpoint at `path`."""
    main, mtp = load(path)
    rng = np.random.default_rng(SEED)
    ids = torch.from_numpy(rng.integers(0, main.config.text_config.vocab_size, (BATCH, SEQ_LEN)))
    with torch.no_grad():
        out = main(input_ids=ids, output_hidden_states=True)
        hidden = out.hidden_states[-1]
        np.testing.assert_array_equal(main.lm_head(hidden).numpy(), out.logits.numpy())
        draft = _draft(main, mtp, hidden, ids, first_pos=1)
        np.testing.assert_allclose(_draft(main, mtp, hidden, ids, first_pos=0), draft,
                                   rtol=0, atol=1e-5)
        # The path generation takes: `MtpModel.forward` drafts from the last row only.
        _, last, _ = mtp(input_ids=ids[:, 1:], last_hidden_states=hidden[:, :-1],
                         attention_mask=None,
                         position_ids=torch.arange(1, SEQ_LEN)[None].expand(BATCH, -1),
                         mtp_cache=MtpCache(config=main.config.get_mtp_config()))
        np.testing.assert_allclose(last[:, 0], draft[:, -1], rtol=0, atol=1e-5)
    return {"token_ids": ids.numpy().astype(np.int32),
            "hidden": hidden.numpy().astype(np.float32),
            "draft_logits": draft.numpy().astype(np.float32)}


def save_mtp_reference(path: pathlib.Path = FIXTURE) -> None:
    out = path / "mtp_reference.npz"
    np.savez_compressed(out, **mtp_reference(path))
    print(out.name, f"{out.stat().st_size} bytes")


if __name__ == "__main__":
    save_mtp_reference()
