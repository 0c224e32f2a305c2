"""Make a registered Jupyter kernel import minimind_lib before anything else (run by `make kernel`).

minimind_lib's first lines set OpenMP's wait policy (unless the environment already has one), and OpenMP reads it
once, when torch loads: a notebook that imports torch in its first cell would otherwise get the spinning default.
The kernel spec's `env` cannot do this: Jupyter lets the spec's values override the learner's own variables.

    python tools/kernel_imports_library.py minimind
"""

import json
import sys

from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

# What ipykernel_launcher does (take the working directory off sys.path while the kernel loads; IPython puts it
# back), with minimind_lib imported first.
LAUNCH = ("import sys; sys.path[:1] = [p for p in sys.path[:1] if p]; import minimind_lib; "
          "from ipykernel import kernelapp; kernelapp.launch_new_instance()")


def main(name: str) -> int:
    """Rewrite the kernel spec `name`'s argv to start through LAUNCH; print what it did."""
    try:
        spec_dir = KernelSpecManager().get_kernel_spec(name).resource_dir
    except NoSuchKernel:
        print(f"error: no Jupyter kernel named {name!r}: run `make kernel` first", file=sys.stderr)
        return 2
    path = f"{spec_dir}/kernel.json"
    with open(path, encoding="utf-8") as f:
        spec = json.load(f)
    python = spec["argv"][0]
    spec["argv"] = [python, "-c", LAUNCH, "-f", "{connection_file}"]
    with open(path, "w", encoding="utf-8") as f:
        json.dump(spec, f, indent=1)
    print(f"kernel {name!r} imports minimind_lib first (OpenMP's wait policy before torch): {path}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tools/kernel_imports_library.py KERNEL_NAME")
    sys.exit(main(sys.argv[1]))
