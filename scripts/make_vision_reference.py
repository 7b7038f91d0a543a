"""Builds `tests/fixtures/vision/`: a tiny Qwen3.5 vision-language model and transformers'
outputs on it (dev tier: needs torch and transformers).

    pip install -e '.[dev]' && python scripts/make_vision_reference.py

What it writes:

- `config.json`, `model.safetensors`: `Qwen3_5ForConditionalGeneration` (the real layout:
  `model.visual.*`, `model.language_model.*`, `lm_head.*`) with random weights (seed SEED), the
  `dense` fixture's text dimensions and a two-block vision tower (patch 8, merge 2, an 8x8
  learned position grid, so every image's grid is resampled), its special tokens inside the
  vocabulary. Every weight is perturbed (`make_reference.perturb`) so norms and biases matter.
- `preprocessor_config.json`, `video_preprocessor_config.json`: the processor settings of the
  model (patch 8, mean/std 0.5; 1,024-16,384 pixels an image, 4,096-65,536 a video).
- `tokenizer.json`, `tokenizer_config.json`, `chat_template.jinja`: a byte-level tokenizer
  (ids 0..255 are the bytes) with the chat control tokens and the vision tokens at the model's
  ids, and the official Qwen3.5 chat template (from `../shared/data`).
- `images/`: test images drawn here (no downloads), of different sizes, aspect ratios and modes
  (RGB, RGBA, L, P; PNG and JPEG).
- `preprocess.json`: for every image and three processor settings (the model's; Qwen3-VL's
  published ones, patch 16, 65,536-16,777,216 pixels, mean/std 0.5; and the class defaults,
  patch 14, CLIP mean/std), transformers' `Qwen2VLImageProcessorPil` grid and the sha256 of its
  float32 `pixel_values`.
- `reference.npz`: for three prompts (one image; two images of different sizes; a four-frame
  video as two temporal patches, each frame group after its timestamp text), the token ids, the
  pixel values given to the model, the vision tower's merged embeddings, `get_rope_index`'s
  position ids and delta, the full fp32 logits, and GREEDY greedy tokens (full re-forward each
  step, the positions recomputed by transformers).

The tests compare against these files and never import torch.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import sys

import numpy as np
import torch
from PIL import Image, ImageDraw
from safetensors.torch import save_file
from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from scripts.make_reference import DENSE, perturb

OUT = pathlib.Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "vision"
SHARED = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data"
SEED, GREEDY = 5, 6
VISION_START, VISION_END, IMAGE, VIDEO = 378, 379, 380, 381
VISION = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
          "out_hidden_size": DENSE["hidden_size"], "patch_size": 8, "temporal_patch_size": 2,
          "spatial_merge_size": 2, "num_position_embeddings": 64,
          "hidden_act": "gelu_pytorch_tanh"}
PROCESSOR = {"patch_size": 8, "temporal_patch_size": 2, "merge_size": 2,
             "size": {"shortest_edge": 1024, "longest_edge": 16384},
             "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
VIDEO_PROCESSOR = {"patch_size": 8, "temporal_patch_size": 2, "merge_size": 2,
                   "size": {"shortest_edge": 4096, "longest_edge": 65536},
                   "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
SETTINGS = {
    "model": PROCESSOR,
    "qwen3_vl": {"patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
                 "size": {"shortest_edge": 65536, "longest_edge": 16777216},
                 "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]},
    "defaults": {},
}


def draw(width: int, height: int, seed: int, mode: str = "RGB") -> Image.Image:
    """A deterministic test picture: a colour gradient, shapes, a little noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    rgb = np.stack([255 * x / max(width - 1, 1), 255 * y / max(height - 1, 1),
                    127 + 100 * np.sin((x + y) / 7.0)], -1)
    rgb += rng.normal(0, 12, rgb.shape)
    image = Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8), "RGB")
    d = ImageDraw.Draw(image)
    for _ in range(4):
        x0, y0 = int(rng.integers(0, width)), int(rng.integers(0, height))
        x1, y1 = x0 + int(rng.integers(3, width // 2 + 4)), y0 + int(rng.integers(3, height // 2 + 4))
        colour = tuple(int(c) for c in rng.integers(0, 256, 3))
        (d.ellipse if rng.random() < 0.5 else d.rectangle)((x0, y0, x1, y1), fill=colour)
    if mode == "RGBA":
        alpha = np.clip(255 * x / max(width - 1, 1), 0, 255).astype(np.uint8)
        image.putalpha(Image.fromarray(alpha, "L"))
    elif mode == "L":
        image = image.convert("L")
    elif mode == "P":
        image = image.convert("P", palette=Image.ADAPTIVE, colors=32)
    return image


IMAGES = {  # name -> (width, height, seed, mode)
    "grad_64x48.png": (64, 48, 1, "RGB"),
    "noise_53x37.png": (53, 37, 2, "RGB"),
    "shapes_200x120.png": (200, 120, 3, "RGB"),
    "tall_97x300.png": (97, 300, 4, "RGB"),
    "wide_1000x20.png": (1000, 20, 5, "RGB"),
    "alpha_80x60.png": (80, 60, 6, "RGBA"),
    "gray_50x70.png": (50, 70, 7, "L"),
    "palette_64x64.png": (64, 64, 8, "P"),
    "photo_640x480.jpg": (640, 480, 9, "RGB"),
}
FRAMES = [f"frame{i}_64x48.png" for i in range(4)]


def write_frontend() -> None:
    """A byte-level tokenizer whose ids 0..255 are the bytes, the chat control tokens, and the
    vision tokens at the model's ids; the official Qwen3.5 chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = {}, 0
    for b in range(256):  # GPT-2's byte -> unicode table
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    tok = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    specials += [f"<|extra_{i}|>" for i in range(VISION_START - 256 - len(specials))]
    specials += ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t in ("<think>", "</think>")])
    assert tok.token_to_id("<|image_pad|>") == IMAGE and tok.get_vocab_size() == 384
    tok.save(str(OUT / "tokenizer.json"))
    (OUT / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, indent=2) + "\n")
    template = SHARED / "qwen-tokenizer" / "qwen3.5" / "chat_template.jinja"
    (OUT / "chat_template.jinja").write_text(template.read_text())


def write_images() -> None:
    (OUT / "images").mkdir(parents=True, exist_ok=True)
    for name, (w, h, seed, mode) in IMAGES.items():
        image = draw(w, h, seed, mode)
        image.save(OUT / "images" / name, **({"quality": 90} if name.endswith(".jpg") else {}))
    for i, name in enumerate(FRAMES):
        draw(64, 48, 100 + i).save(OUT / "images" / name)


def load(name: str) -> Image.Image:
    with Image.open(OUT / "images" / name) as f:
        f.load()
        return f.copy()


def processor(settings: dict) -> Qwen2VLImageProcessorPil:
    return Qwen2VLImageProcessorPil(**settings)


def preprocess_reference() -> dict:
    out = {}
    for key, settings in SETTINGS.items():
        proc = processor(settings)
        out[key] = {"settings": settings, "images": {}}
        for name in IMAGES:
            r = proc(images=[load(name)], return_tensors="np")
            pixels = np.ascontiguousarray(r["pixel_values"], dtype=np.float32)
            out[key]["images"][name] = {
                "grid": [int(x) for x in r["image_grid_thw"][0]],
                "shape": list(pixels.shape),
                "sha256": hashlib.sha256(pixels.tobytes()).hexdigest()}
    return out


def video_pixels(frames: list[np.ndarray], settings: dict) -> tuple[np.ndarray, list[int]]:
    """The four frames (each already a processed image, [C, H, W]) as the video processor's
    patch layout: (t, block row, block col, row, col) x (C, temporal, patch, patch)."""
    p, m, tp = settings["patch_size"], settings["merge_size"], settings["temporal_patch_size"]
    x = np.stack(frames)
    n, c, h, w = x.shape
    gt, gh, gw = n // tp, h // p, w // p
    x = x.reshape(gt, tp, c, gh // m, m, p, gw // m, m, p).transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return np.ascontiguousarray(x.reshape(gt * gh * gw, c * tp * p * p)), [gt, gh, gw]


def frame_arrays(settings: dict) -> list[np.ndarray]:
    """Each frame through the image processor's resize and normalisation: [C, H, W]."""
    proc = processor(settings)
    out = []
    for name in FRAMES:
        r = proc(images=[load(name)], return_tensors="np")
        _, gh, gw = r["image_grid_thw"][0]
        p, m = settings["patch_size"], settings["merge_size"]
        # undo the image patchify (its two temporal copies are equal): back to [C, H, W]
        x = r["pixel_values"].reshape(gh // m, gw // m, m, m, 3, 2, p, p)[:, :, :, :, :, 0]
        out.append(x.transpose(4, 0, 2, 5, 1, 3, 6).reshape(3, gh * p, gw * p))
    return out


def prompts() -> dict:
    proc = processor(PROCESSOR)
    one = proc(images=[load("grad_64x48.png")], return_tensors="np")
    two = proc(images=[load("shapes_200x120.png"), load("noise_53x37.png")], return_tensors="np")
    video, vgrid = video_pixels(frame_arrays(PROCESSOR), PROCESSOR)
    rng = np.random.default_rng(SEED)

    def text(n):
        return rng.integers(0, 256, n).tolist()

    def run(grid):
        return [VISION_START] + [IMAGE] * (int(np.prod(grid)) // 4) + [VISION_END]

    g1 = one["image_grid_thw"].tolist()
    g2 = two["image_grid_thw"].tolist()
    frame = [1, vgrid[1], vgrid[2]]
    return {
        "one_image": {"ids": text(5) + run(g1[0]) + text(4), "pixel_values": one["pixel_values"],
                      "image_grid_thw": g1},
        "two_images": {"ids": text(3) + run(g2[0]) + text(2) + run(g2[1]) + text(4),
                       "pixel_values": two["pixel_values"], "image_grid_thw": g2},
        "video": {"ids": text(3) + text(2) + [VISION_START] + [VIDEO] * (int(np.prod(frame)) // 4)
                  + [VISION_END] + text(2) + [VISION_START] + [VIDEO] * (int(np.prod(frame)) // 4)
                  + [VISION_END] + text(4),
                  "pixel_values_videos": video, "video_grid_thw": [vgrid]},
    }


def model_inputs(p: dict, ids: list[int]) -> dict:
    t = torch.tensor([ids])
    kw = {"input_ids": t, "mm_token_type_ids": (t == IMAGE).int() + 2 * (t == VIDEO).int()}
    if "pixel_values" in p:
        kw.update(pixel_values=torch.from_numpy(np.asarray(p["pixel_values"], np.float32)),
                  image_grid_thw=torch.tensor(p["image_grid_thw"]))
    else:
        kw.update(pixel_values_videos=torch.from_numpy(p["pixel_values_videos"]),
                  video_grid_thw=torch.tensor(p["video_grid_thw"]))
    return kw


def main() -> None:
    torch.manual_seed(SEED)
    cfg = Qwen3_5Config(text_config=DENSE, vision_config=VISION, tie_word_embeddings=True,
                        image_token_id=IMAGE, video_token_id=VIDEO,
                        vision_start_token_id=VISION_START, vision_end_token_id=VISION_END)
    model = Qwen3_5ForConditionalGeneration(cfg).eval()
    perturb(model, seed=SEED)
    with torch.no_grad():  # the vision tower's weights too, biases included
        g = torch.Generator().manual_seed(SEED + 1)
        for name, p in model.model.visual.named_parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    model.tie_weights()
    OUT.mkdir(parents=True, exist_ok=True)
    write_images()
    write_frontend()
    model.config.save_pretrained(OUT)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(OUT / "model.safetensors"), metadata={"format": "pt"})
    (OUT / "preprocessor_config.json").write_text(json.dumps(
        {"image_processor_type": "Qwen2VLImageProcessor", **PROCESSOR}, indent=2) + "\n")
    (OUT / "video_preprocessor_config.json").write_text(json.dumps(
        {"video_processor_type": "Qwen3VLVideoProcessor", **VIDEO_PROCESSOR}, indent=2) + "\n")
    (OUT / "preprocess.json").write_text(json.dumps(preprocess_reference(), indent=1) + "\n")

    ref = {}
    with torch.no_grad():
        for name, p in prompts().items():
            ids = p["ids"]
            kw = model_inputs(p, ids)
            if "pixel_values" in p:
                feats = model.model.get_image_features(kw["pixel_values"], kw["image_grid_thw"])
            else:
                feats = model.model.get_video_features(kw["pixel_values_videos"],
                                                       kw["video_grid_thw"])
            embeds = torch.cat(feats.pooler_output).numpy()
            pos, delta = model.model.get_rope_index(
                kw["input_ids"], kw["mm_token_type_ids"], kw.get("image_grid_thw"),
                kw.get("video_grid_thw"))
            logits = model(**kw).logits[0].numpy()
            seq = list(ids)
            for _ in range(GREEDY):  # full re-forward: transformers recomputes the positions
                out = model(**model_inputs(p, seq)).logits[0, -1]
                seq.append(int(out.argmax()))
            pixels = p.get("pixel_values", p.get("pixel_values_videos"))
            ref.update({f"{name}/ids": np.asarray(ids, np.int32),
                        f"{name}/pixels": np.asarray(pixels, np.float32),
                        f"{name}/grids": np.asarray(p.get("image_grid_thw",
                                                          p.get("video_grid_thw")), np.int32),
                        f"{name}/embeds": embeds.astype(np.float32),
                        f"{name}/positions": pos[:, 0].numpy().astype(np.int32),
                        f"{name}/delta": np.asarray(int(delta[0, 0]), np.int32),
                        f"{name}/logits": logits.astype(np.float32),
                        f"{name}/greedy": np.asarray(seq[len(ids):], np.int32)})
            print(f"{name}: {len(ids)} tokens, {embeds.shape[0]} vision tokens, "
                  f"delta {int(delta[0, 0])}, greedy {seq[len(ids):]}")
    np.savez_compressed(OUT / "reference.npz", **ref)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
