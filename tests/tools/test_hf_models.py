"""benchmarks/hf_models.py: every variant it times is one a user can run (torch's selective
checkpoint included) and gives HF's gradients, and its Markdown lands between the markers."""

from __future__ import annotations


import pytest

from tests._models import hf_transformers
from tests._benchmarks import load_benchmark



@pytest.fixture(scope="module")
def hf_models():
    hf_transformers()   # skips without the hf extra
    return load_benchmark("hf_models")


@pytest.mark.slow
def test_every_variant_gives_the_plain_gradients_and_undoes_itself(hf_models, monkeypatch):
    monkeypatch.setattr(hf_models, "SEQ", 16)
    model = hf_models.models()["GPT-2 4x128"]()
    inputs = hf_models.batch()
    plain = hf_models.step(model, inputs)
    plain = (plain[0], {name: grad.clone() for name, grad in plain[1].items()})
    table = hf_models.variants(model, inputs, budgets=[])
    assert {"none", "HF switch", "ckptlib save_matmuls", "torch SAC save_matmuls"} <= set(table)
    for name, setup in table.items():
        with setup():
            assert hf_models.bitwise(hf_models.step(model, inputs), plain), name
        assert hf_models.bitwise(hf_models.step(model, inputs), plain), f"{name} left behind"


def test_the_tables_land_between_the_markers(hf_models, tmp_path):
    row = {"bitwise_vs_none": True, "bitwise_vs_hf": False, "peak_bytes": 3 * 2**20,
           "time_vs_hf": 1.234, "time_vs_hf_quartiles": [1.1, 1.3]}
    result = {"torch": "2.x", "threads": 1, "clock": "process CPU time", "rounds": 3,
              "batch": [4, 64], "models": {"GPT-2": {
                  "saved_bytes_plain": 2**21, "variants": {"ckptlib full": row},
                  "planner": {"100": {"run 1": ["h.0"], "run 2": ["h.0"], "same": True}}}}}
    page = tmp_path / "README.md"
    page.write_text(f"before\n{hf_models.MARKDOWN_BEGIN}\nold\n{hf_models.MARKDOWN_END}\nafter\n")
    hf_models.write_between_markers(page, hf_models.MARKDOWN_BEGIN, hf_models.MARKDOWN_END,
                                    hf_models.markdown(result), "hf-models")
    text = page.read_text()
    assert text.startswith("before\n") and text.endswith("after\n") and "old" not in text
    assert "| ckptlib full | yes | **no** | 3.00 | 1.23 | 1.10 to 1.30 |" in text
    assert "**GPT-2** (plain autograd saves 2.0 MiB)" in text
    with pytest.raises(SystemExit, match="has no hf-models markers"):
        hf_models.write_between_markers(page, "<!-- x -->", "<!-- y -->", "", "hf-models")
