"""The README's "library in five lines" is code a reader will paste: it must run."""
import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def test_five_line_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README.md has no python example"
    namespace: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), namespace)
    assert namespace["report"].peak_bytes > 0
    namespace["y"].sum().backward()
    assert namespace["x"].grad is not None
