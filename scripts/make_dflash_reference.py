"""Writes tests/fixtures/dflash2/: a tiny random DFlash2 drafter in the public checkpoint layout
(config.json + model.safetensors; its dimensions fit `tests/fixtures/dense` as a target) and the
public reference implementation's outputs on it (reference.npz), which
`tests/models/test_dflash_reference.py` compares with ours.

The reference is z-lab/dflash's `dflash/model.py` (commit 10129599dffb338ff38cfd235a53ca6d3667b4dd,
the first with `DFlash2DraftModel`), loaded from the path given by --reference; it is not part of
this repository. It needs the dev extra (torch, transformers).

    python scripts/make_dflash_reference.py --reference=/path/to/dflash/model.py

Two cases: a context shorter than the sliding window and one longer than it. For each: the
block's hidden states, the full lm-head proposal's logits at the draft positions, the selector's
greedy path, and one sampled path (temperature 0.8) with its q rows over the candidates.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("reference", None, "path to z-lab/dflash's dflash/model.py", required=True)
flags.DEFINE_string("out", "tests/fixtures/dflash2", "output directory")

CONFIG = {
    "architectures": ["DFlash2DraftModel"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "is_causal": False,
    "dflash_config": {
        "block_size": 8,
        "conv_group_size": 16,
        "conv_kernel_size": 2,
        "final_logit_softcapping": 20.0,
        "mask_token_id": 95,
        "output_multiplier": 0.5,
        "selector_rank": 8,
        "selector_top_k": 6,
        "target_layer_ids": [0, 2],
    },
    "dtype": "float32",
    "head_dim": 16,
    "hidden_act": "silu",
    "hidden_size": 64,
    "intermediate_size": 128,
    "layer_types": ["sliding_attention", "full_attention"],
    "max_position_embeddings": 512,
    "max_window_layers": 2,
    "model_type": "qwen3",
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "num_target_layers": 4,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    "sliding_window": 12,
    "tie_word_embeddings": False,
    "use_sliding_window": True,
    "vocab_size": 384,
}
CONTEXT_LENGTHS = (5, 20)
TEMPERATURE = 0.8


def main(argv):
    del argv
    import numpy as np
    import torch
    from safetensors.torch import save_file
    from torch.nn import functional as F
    from transformers import Qwen3Config

    spec = importlib.util.spec_from_file_location("dflash_reference", FLAGS.reference)
    ref = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ref)

    torch.manual_seed(0)
    config = Qwen3Config(**CONFIG)
    model = ref.DFlash2DraftModel(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.copy_(0.2 * torch.randn_like(param))
    out = pathlib.Path(FLAGS.out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, param in model.state_dict().items():
        if name.startswith("candidate_selector.") and "codebook" in name:
            name = name.removesuffix(".weight")  # the official layout's names
        tensors[name] = param.detach().contiguous()
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(CONFIG, indent=2) + "\n")

    v, h = CONFIG["vocab_size"], CONFIG["hidden_size"]
    bs = CONFIG["dflash_config"]["block_size"]
    nf = len(CONFIG["dflash_config"]["target_layer_ids"])
    embed = 0.5 * torch.randn(v, h)
    head = torch.nn.Linear(h, v, bias=False)
    with torch.no_grad():
        head.weight.copy_(0.5 * torch.randn(v, h))
    arrays = {"embed": embed.numpy(), "head": head.weight.detach().numpy()}
    with torch.no_grad():
        for case, n in enumerate(CONTEXT_LENGTHS):
            features = torch.randn(1, n, nf * h)
            anchor = torch.tensor([case + 7])
            block = torch.full((1, bs), CONFIG["dflash_config"]["mask_token_id"])
            block[0, 0] = anchor
            positions = torch.arange(n + bs)[None]
            hidden = model(target_hidden=features, noise_embedding=F.embedding(block, embed),
                           position_ids=positions)
            drafts = hidden[:, 1:]
            logits = model.compute_logits(drafts, head)
            path, candidates, _ = model.propose(drafts, anchor, head, 0.0)
            torch.manual_seed(100 + case)
            sampled, sampled_candidates, q = model.propose(drafts, anchor, head, TEMPERATURE)
            arrays.update({
                f"features_{case}": features.numpy(), f"anchor_{case}": anchor.numpy(),
                f"hidden_{case}": hidden.numpy(), f"logits_{case}": logits.numpy(),
                f"greedy_path_{case}": path.numpy(), f"sampled_path_{case}": sampled.numpy(),
                f"sampled_candidates_{case}": sampled_candidates.numpy(),
                f"sampled_q_{case}": q.numpy(),
            })
    np.savez_compressed(out / "reference.npz", temperature=TEMPERATURE,
                        context_lengths=np.array(CONTEXT_LENGTHS), **arrays)
    print(f"wrote {out}: {sorted(p.name for p in out.iterdir())}")


if __name__ == "__main__":
    app.run(main)
