"""What the GPU machine lacks and how it gets it: the wheels the one-GPU check carries (the image
has CUDA torch, transformers and peft, not datasets or TRL), their download for its Python, and
the check of the versions installed there."""

import subprocess
import sys
from importlib import metadata

from packaging.requirements import Requirement

from plumbing import stack


# The GPU machine's Python 3.12 has torch, transformers, peft and GPU_IMAGE, not datasets or TRL:
# they travel as wheels (gpu_check.py --wheels .whl), each of whose requirements is carried too or
# already there (a test checks). The suite first checks the versions installed (unmet).
GPU_WHEELS = {"datasets": "5.2.0", "dill": "0.4.1", "multiprocess": "0.70.19", "trl": "1.16.0"}
GPU_IMAGE = {"accelerate", "filelock", "fsspec", "huggingface-hub", "jinja2", "numpy", "packaging",
             "pandas", "peft", "psutil", "pyarrow", "pyyaml", "tqdm", "transformers", "xxhash"}
GPU_IMPORTS = ["datasets", "trl", "peft"]  # what the suite needs beyond torch and transformers


def download_wheels(dest, pins):
    """GPU_WHEELS and pins (NAME==VERSION) for CPython 3.12 on x86-64 Linux, without their
    requirements (the image's)."""
    pins = [f"{name}=={version}" for name, version in GPU_WHEELS.items()] + pins
    platforms = ["--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64"]
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", dest,
                    *pins], check=True, timeout=600)


def unmet(names):
    """What the installed packages lack for `names` and their own requirements: 'trl: not
    installed', 'pyarrow 19.0.0 (for datasets): needs >=24.0.0'. [] when nothing."""
    problems = [f"{name}: not installed" for name in names if stack.version(name) is None]
    for name in [name for name in names if stack.version(name) is not None]:
        for req in map(Requirement, metadata.requires(name) or []):
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue  # an extra's, or another platform's
            have = stack.version(req.name)
            if have is None or not req.specifier.contains(have, prereleases=True):
                problems.append(f"{req.name} {have or 'not installed'} (for {name}): needs "
                                f"{req.specifier or 'it'}")
    return sorted(set(problems))
