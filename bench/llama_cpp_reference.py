"""llama.cpp for the benches to measure against: built from the llama.cpp that the PyPI package
llama-cpp-python vendors, in the bench's own directory (nothing is installed into the project's
environment), and our HF checkpoints converted with its own converter.

    from llama_cpp_reference import LlamaCpp
    llama = LlamaCpp.build(Path("~/.cache/deepinfer-bench").expanduser())   # ~15 minutes the first time
    gguf = llama.convert(checkpoint, work / "model-q8_0.gguf", "q8_0")
    llama.bench(gguf, depth=32, tokens=16)                                   # ms a generated token

`build` downloads the sdist with pip (no install), builds llama-bench, llama-server and
llama-quantize with CMake for this CPU (GGML_NATIVE), and keeps them for the next run.
"""

import json
import subprocess
import sys
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

VERSION = "0.3.36"  # llama-cpp-python, whose vendored llama.cpp the probe measured
TARGETS = ("llama-bench", "llama-server", "llama-quantize")
CONVERT = """import runpy, sys
root = sys.argv.pop(1)
sys.path[:0] = [root + "/gguf-py", root]
from conversion import base
# deepinfer's tiny tokenizers are byte-level BPE with GPT-2's pre-tokenizer, which the converter
# recognizes only by hashing known vocabularies: say it.
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
sys.argv[0] = root + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@dataclass
class LlamaCpp:
    source: Path  # the vendored llama.cpp tree
    bin: Path
    packing: dict = field(default_factory=dict)  # GGUF -> whether it runs repacked (`repacks`)

    @classmethod
    def build(cls, directory: Path) -> "LlamaCpp":
        directory.mkdir(parents=True, exist_ok=True)
        source = directory / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"
        bin = source / "build" / "bin"
        if all((bin / t).exists() for t in TARGETS):
            return cls(source, bin)
        sdist = directory / f"llama_cpp_python-{VERSION}.tar.gz"
        if not sdist.exists():
            _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", f"llama-cpp-python=={VERSION}",
                  "-d", str(directory)])
        with tarfile.open(sdist) as archive:
            archive.extractall(directory, filter="data")
        print(f"building llama.cpp {VERSION} (vendored by llama-cpp-python) for this CPU: ~15 minutes on 2 cores", flush=True)
        _run(["cmake", "-S", str(source), "-B", str(source / "build"), "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
              "-DLLAMA_BUILD_TESTS=OFF", "-DCMAKE_BUILD_TYPE=Release"])
        _run(["cmake", "--build", str(source / "build"), "-j2", "--target", *TARGETS])
        return cls(source, bin)

    def convert(self, checkpoint: Path, out: Path, kind: str) -> Path:
        """An HF checkpoint -> GGUF of `kind`: f32, bf16 or q8_0 by the converter, q4_0 by
        llama-quantize from the f32 file."""
        if out.exists():
            return out
        if kind == "q4_0":
            f32 = self.convert(checkpoint, out.with_name(out.name.replace("q4_0", "f32")), "f32")
            _run([str(self.bin / "llama-quantize"), str(f32), str(out), "q4_0"])
        else:
            _run([sys.executable, "-c", CONVERT, str(self.source), str(checkpoint), "--outfile", str(out), "--outtype", kind])
        return out

    def bench(self, gguf: Path, prompt: int = 0, depth: int = 0, tokens: int = 0, repetitions: int = 1) -> float:
        """llama-bench on 2 threads: ms a generated token after `depth` tokens of context (tokens > 0),
        or ms to process a `prompt`-token prompt (its time to first token, sampling aside)."""
        run = _run([str(self.bin / "llama-bench"), "-m", str(gguf), "-t", "2", "-p", str(prompt), "-n", str(tokens),
                    "-d", str(depth), "-r", str(repetitions), "-o", "json", "--repack", str(int(self.repacks(gguf)))])
        (result,) = json.loads(run.stdout)
        return result["avg_ns"] / 1e6 / (tokens or 1)


    def repacks(self, gguf: Path) -> bool:
        """Whether llama.cpp runs `gguf` with its weights repacked, its default (the layouts of its
        fastest CPU kernels; AMX's on Xeons that have it). On a Xeon with AMX, 0.3.36's AMX layout
        of q8_0 fails an assert in every run (ggml-backend.cpp:1294, `*cur_backend_id != -1`):
        such a model is run unpacked, and said so once."""
        if gguf not in self.packing:
            probe = subprocess.run([str(self.bin / "llama-bench"), "-m", str(gguf), "-t", "2", "-p", "0", "-n", "1", "-r", "1"],
                                   capture_output=True, text=True)
            if probe.returncode and "cur_backend_id" not in probe.stderr:
                raise RuntimeError(f"llama-bench on {gguf} failed ({probe.returncode}):\n{probe.stderr[-3000:]}")
            self.packing[gguf] = probe.returncode == 0
            if probe.returncode:
                print(f"  llama.cpp: {gguf.name} fails repacked on this CPU (its AMX layout: ggml-backend.cpp "
                      f"`*cur_backend_id != -1`); run unpacked (--repack 0)", flush=True)
        return self.packing[gguf]

def _run(command: list[str]) -> subprocess.CompletedProcess:
    run = subprocess.run(command, capture_output=True, text=True)
    if run.returncode:
        raise RuntimeError(f"{' '.join(command[:3])} ... failed ({run.returncode}):\n{run.stderr[-3000:]}")
    return run
