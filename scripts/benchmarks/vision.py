"""Vision: the vision encoder per image size and the time to first token of an image prompt,
ours next to transformers, each in its own process, taking turns.

    python scripts/bench.py --suite=vision --out=DIR

On the `vision` test fixture (`tests/fixtures/vision`: a tiny `Qwen3_5ForConditionalGeneration`,
random fp32 weights, patch 8, 1,024-16,384 pixels an image; `BENCH_VISION_MODEL=DIR` for another
vision-language checkpoint with its processor settings and frontend), two long-lived workers
load the same directory: ours (`workers/vision_jax.py`: the Program's compiled encoder buckets,
the Frontend's preprocessing) and transformers (`workers/vision_hf.py`: its PIL image
processor and model, fp32, `inference_mode`, 2 torch threads). Set-up is reported apart; then,
for each test image, one warm-up repetition per side and REPS in turn, with the load around
each:

- encode: the decoded image preprocessed and through the vision tower (both sides include
  their preprocessing); the embeddings' sums are compared.
- ttft: the chat prompt "<image> Describe it." (thinking off) to its first token: ours prepares
  the prompt, admits it, encodes and prefills; transformers gets the same token ids and runs
  its processor and one forward. The first tokens are compared.

Per image: ms median [min-max] each side, ours/transformers speed per turn pair (> 1: ours
faster), agreement. Settings: BENCH_VISION_MODEL, BENCH_VISION_IMAGES (names under the
fixture's images/), BENCH_VISION_REPS=5, BENCH_VISION_WARMUP=1, BENCH_TIMEOUT_S=1800,
BENCH_TORCH_OMP_WAIT_POLICY (see `_env.py`).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import time

from scripts.benchmarks._abab import Worker, alternate, fmt_spread, progress, strip_outputs
from scripts.benchmarks._env import env_int, torch_worker_env

REPO = pathlib.Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests" / "fixtures" / "vision"
IMAGES = ("grad_64x48.png", "shapes_200x120.png", "tall_97x300.png", "photo_640x480.jpg")
TEXT = "Describe it."


@dataclasses.dataclass(frozen=True)
class Settings:
    model: str = str(FIXTURE)
    images: tuple[str, ...] = IMAGES
    reps: int = 5
    warmup: int = 1
    timeout_s: int = 1800
    torch_env: dict = dataclasses.field(default_factory=dict)

    @classmethod
    def from_env(cls) -> Settings:
        d = cls()
        images = os.environ.get("BENCH_VISION_IMAGES")
        return cls(model=os.environ.get("BENCH_VISION_MODEL", d.model),
                   images=tuple(images.split(",")) if images else d.images,
                   reps=env_int("BENCH_VISION_REPS", d.reps),
                   warmup=env_int("BENCH_VISION_WARMUP", d.warmup, minimum=0),
                   timeout_s=env_int("BENCH_TIMEOUT_S", d.timeout_s),
                   torch_env=torch_worker_env())


def _prompt_ids(model: pathlib.Path, image: pathlib.Path) -> list[int]:
    """The token ids of the ttft prompt, as our Frontend renders them (no jax needed)."""
    from ninfer_jax.frontend import Frontend
    from ninfer_jax.models.qwen3_6.config import ModelConfig

    frontend = Frontend.load(model, ModelConfig.from_hf_dir(model))
    messages = [{"role": "user", "content": [{"type": "image", "image": str(image)},
                                             {"type": "text", "text": TEXT}]}]
    return list(frontend.prepare(messages=messages, enable_thinking=False).token_ids)


def measure(s: Settings) -> dict:
    model = pathlib.Path(s.model)
    timeouts = {"setup_timeout_s": 2 * s.timeout_s, "timeout_s": s.timeout_s}
    out = {"model": str(model), "setup": {}, "images": {}}
    with Worker("transformers", "scripts.benchmarks.workers.vision_hf", env=s.torch_env,
                **timeouts) as hf, \
            Worker("ours", "scripts.benchmarks.workers.vision_jax", **timeouts) as ours:
        for w, args in ((hf, {"path": str(model)}),
                        (ours, {"path": str(model), "max_vision_patches": 1024})):
            progress(f"vision: set-up of {w.name}")
            out["setup"][w.name] = {**w.setup(args), "wall_s": w.setup_s}
        out["setup"]["transformers"]["env"] = s.torch_env
        for name in s.images:
            image = model / "images" / name
            results = {}
            for kind in ("encode", "ttft"):
                progress(f"vision: {name} {kind}")
                args = {"kind": kind, "image": str(image)}
                if kind == "ttft":
                    args.update(text=TEXT, ids=_prompt_ids(model, image))
                r = alternate([ours, hf], kind, args, reps=s.reps, warmup=s.warmup)
                o, t = r["sides"]["ours"], r["sides"]["transformers"]
                first_o, first_t = o["outputs"][0], t["outputs"][0]
                if kind == "encode":
                    r["agreement"] = {
                        "shape": first_o["shape"] == first_t["shape"],
                        "sum_abs_diff": abs(first_o["sum"] - first_t["sum"])}
                else:
                    r["agreement"] = {"same_first_token": all(
                        a["token"] == b["token"] for a, b in zip(o["outputs"], t["outputs"])),
                        "prompt_tokens": first_o["prompt_tokens"]}
                results[kind] = strip_outputs(r)
            out["images"][name] = results
    return out


def format_table(r: dict) -> str:
    su = r["setup"]
    setup = (f"  set-up: ours {su['ours']['wall_s']:.1f} s (encoder buckets "
             f"{su['ours']['buckets']}), transformers {su['transformers']['wall_s']:.1f} s "
             f"({su['transformers']['threads']} torch threads)")
    header = (f"  {'image':<20}{'step':<8}{'ours ms':>22}{'transformers ms':>22}"
              f"{'ours/hf speed':>20}  agreement   load 1-min")
    lines = [f"vision model {r['model']}", setup, header]
    for name, kinds in r["images"].items():
        for kind, m in kinds.items():
            o, t = m["sides"]["ours"]["seconds"], m["sides"]["transformers"]["seconds"]
            ms = {k: {x: v * 1e3 for x, v in side.items() if x != "n"}
                  for k, side in (("o", o), ("t", t))}
            a = m["agreement"]
            agree = (f"sum diff {a['sum_abs_diff']:.1e}" if kind == "encode"
                     else f"first token {'=' if a['same_first_token'] else '!='} "
                          f"({a['prompt_tokens']} tok)")
            load = m["load_1min"]
            lines.append(f"  {name:<20}{kind:<8}{fmt_spread(ms['o'], 2):>22}"
                         f"{fmt_spread(ms['t'], 2):>22}"
                         f"{fmt_spread(m['ratios']['ours/transformers'], 2):>20}  {agree}"
                         f"   {load['min']:.1f}-{load['max']:.1f}")
    lines.append("ms: median [min-max] over the repetitions; ours/hf: the per-pair ratio of "
                 "rates (> 1: ours faster)")
    return "\n".join(lines)


def run(out_dir: str) -> dict:
    del out_dir  # bench.py writes the JSON; the table is printed
    s = Settings.from_env()
    start, load_start = time.perf_counter(), os.getloadavg()
    progress(f"settings {s}")
    result = measure(s)
    table = format_table(result)
    print(table)
    return {"settings": dataclasses.asdict(s), "result": result, "table": table,
            "load_average_start": load_start, "load_average_end": os.getloadavg(),
            "cpu_count": os.cpu_count(), "wall_s": time.perf_counter() - start}
