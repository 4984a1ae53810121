"""SFT data (prl.trainer.sft_data) and the SFT config: the loss mask holds exactly the assistant
messages' tokens as the model's chat template renders them, the order of rows is a function of the
step, every format loads alike, and bad data or config is refused naming the key or the row.

    pytest tests/unit/test_sft_data.py
"""

import json
import subprocess
import sys

import pytest

from helpers import ROOT
from prl.config import ConfigError, load_config
from prl.config.sft import SftConfig
from prl.trainer.sft_data import DataError, DataOrder, load_rows, tokenize

SFT = ROOT / "configs/sft_toy.yaml"
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "aeiou"}, {"role": "user", "content": "Again?"},
                {"role": "assistant", "content": "oo ea"}]


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def test_the_mask_holds_each_assistant_message_and_its_end_of_turn(tokenizer):
    sample, cut = tokenize(tokenizer, CONVERSATION, 512, row=0)
    assert not cut and len(sample.input_ids) == len(sample.loss_mask)
    assert sample.input_ids == tokenizer(tokenizer.apply_chat_template(CONVERSATION, tokenize=False),
                                         add_special_tokens=False)["input_ids"]
    # The masked tokens, decoded run by run, are the two answers with the template's end of turn.
    runs, run = [], []
    for token, masked in zip(sample.input_ids, sample.loss_mask):
        if masked:
            run.append(token)
        elif run:
            runs.append(tokenizer.decode(run))
            run = []
    runs += [tokenizer.decode(run)] if run else []
    assert [r.strip() for r in runs] == ["aeiou<|im_end|>", "oo ea<|im_end|>"], runs
    assert not any(sample.loss_mask[:5])  # the system and user turns are context only


def masked_runs(tokenizer, sample) -> list[str]:
    """The loss mask's runs of tokens, each decoded."""
    runs, run = [], []
    for token, masked in zip(sample.input_ids + [None], sample.loss_mask + [False]):
        if masked:
            run.append(token)
        elif run:
            runs, run = runs + [tokenizer.decode(run)], []
    return runs


def test_a_row_with_tools_renders_them_and_trains_the_calls_not_their_results(tokenizer):
    """The shipped calculator data (sft.tools_key: each row's tool schemas): the template's tools
    block is context, the assistant's call and its answer are trained, the tool's result is not."""
    row = json.loads((ROOT / "prl/envs/data/sft_calculator.jsonl").read_text().splitlines()[0])
    sample, _ = tokenize(tokenizer, row["messages"], 512, 0, row["tools"])
    assert tokenizer.decode(sample.input_ids).count('"name": "add"') == 2  # the tools block and the call
    call = row["messages"][2]["tool_calls"][0]["function"]
    expected_call = f'<tool_call>\n{{"name": "add", "arguments": {call["arguments"]}}}\n</tool_call><|im_end|>'
    assert [r.strip() for r in masked_runs(tokenizer, sample)] == [expected_call, f"= {row['messages'][3]['content']}<|im_end|>"]
    without, _ = tokenize(tokenizer, row["messages"], 512, 0)
    assert "<tools>" in tokenizer.decode(sample.input_ids) and "<tools>" not in tokenizer.decode(without.input_ids)
    with pytest.raises(DataError, match="row 7: tools must be a list of OpenAI tool objects"):
        tokenize(tokenizer, row["messages"], 512, 7, {"add": {}})


def test_a_long_conversation_is_cut_to_the_models_length(tokenizer):
    long = [{"role": "user", "content": "x " * 400}, {"role": "assistant", "content": "a e " * 400}]
    sample, cut = tokenize(tokenizer, long, 64, row=3)
    assert cut and len(sample.input_ids) == 64


@pytest.mark.parametrize("messages, words", [
    ([{"role": "user", "content": "no answer"}], "no assistant message"),
    ("just text", "list of {role, content}"),
    ([{"content": "no role"}], "list of {role, content}"),
])
def test_unusable_rows_are_refused_naming_the_row(tokenizer, messages, words):
    with pytest.raises(DataError, match=f"row 7: .*{words}"):
        tokenize(tokenizer, messages, 512, row=7)


def test_a_template_that_rewrites_history_is_refused(tokenizer):
    """A template that drops earlier assistant turns once a later one follows (as reasoning-stripping
    templates do) gives no prefix to mask by."""
    tokenizer = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    tokenizer.chat_template = ("{% for m in messages %}{% if m.role != 'assistant' or loop.last %}"
                               "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
                               "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(DataError, match="row 1: the chat template renders the turns before message 2 differently"):
        tokenize(tokenizer, CONVERSATION, 512, row=1)


def test_the_order_is_a_function_of_the_step_and_covers_each_pass():
    order = DataOrder(rows_total=10, batch_size=4, seed=3, shuffle=True)
    steps = [order.rows(s) for s in range(5)]  # 20 rows: two whole passes
    assert steps == [DataOrder(10, 4, 3, True).rows(s) for s in range(5)]
    flat = [r for rows in steps for r in rows]
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:]) == list(range(10))
    assert flat[:10] != flat[10:]  # each pass its own permutation
    assert DataOrder(10, 4, 4, True).rows(0) != steps[0]
    assert [DataOrder(10, 4, 3, False).rows(s) for s in range(3)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1]]
    assert order.epoch(5) == 2.0


def test_jsonl_parquet_and_a_saved_dataset_load_the_same_rows(tmp_path):
    import datasets

    rows = [json.loads(line) for line in (ROOT / "prl/envs/data/sft_toy.jsonl").read_text().splitlines()[:5]]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "d.json").write_text(json.dumps(rows))
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "d.parquet"))
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    for name in ("d.jsonl", "d.json", "d.parquet", "saved"):
        assert load_rows(SftConfig(data=str(tmp_path / name))) == rows, name


def test_an_sft_config_has_no_orchestrator_and_splits_its_batch_over_the_ranks():
    cfg = load_config(SFT)
    assert cfg.sft.batch_size == 32 and cfg.orchestrator is None and cfg.components == ("trainer",)
    assert not cfg.het_groups
    for overrides, key in [(["orchestrator.environment.id=prl.envs.toy"], "orchestrator"),
                           (["sft.batch_size=0"], "sft.batch_size"),
                           (["trainer.nodes=3"], "sft.batch_size"),
                           (["slurm.one_node=true", "slurm.hetjob=false"], "slurm.one_node")]:
        with pytest.raises(ConfigError, match=f"^{key}:"):
            load_config(SFT, overrides)
    with pytest.raises(ConfigError, match="^orchestrator: missing required section"):
        load_config(SFT, ["sft=null"])


@pytest.mark.parametrize("override, key", [
    ("sft.data=/nowhere/d.jsonl", "sft.data"), ("sft.data=configs/toy.yaml", "sft.data"),
    ("sft.messages_key=conversation", "sft.messages_key"), ("sft.data=tools/data", "sft.data"),
])
def test_bad_sft_data_is_refused_before_anything_is_written(tmp_path, override, key):
    r = subprocess.run([sys.executable, "-m", "prl.control.cli", "submit", str(SFT), f"run.output_dir={tmp_path}",
                        override, "--dry-run"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.startswith(f"prl: error: {key}:") and len(r.stderr.splitlines()) == 1, r.stderr
    assert not any(tmp_path.iterdir())
