"""The README's usage example runs as written, and the packing demo agrees with the replicated run."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_examples_run():
    """Blocks marked <!-- runnable --> are self-contained; the others need a checkpoint or GPUs."""
    blocks = re.findall(r"<!-- runnable -->\n```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README.md has no runnable python example"
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {})


def test_demo_matches_replicated():
    from dualkv.core.demo import main

    result = main(["--groups", "2", "--n", "3", "--prompt", "40", "--response", "12", "--device", "cpu"])
    assert result["rho"] > 1.5
    assert result["max_err_out"] < 1e-5 and result["max_err_grad"] < 1e-4
