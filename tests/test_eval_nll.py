"""`diffexp eval nll`: the loss by token position on long documents, against a naive per-token loss."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from diffexp.cli import main
from diffexp.training.loading import load_checkpoint, load_model
from tests.helpers import bpe_text_checkpoint, save_checkpoint, small_model

TEXTS = {"a.txt": "the first document is long enough to read", "short.txt": "too short",
         "b.txt": "a second document, also long enough", "c.txt": "and a third one holds even more text"}


def run_eval(args, capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as done:
        main(["eval", *args])
    captured = capsys.readouterr()
    return done.value.code, captured.out + captured.err


def naive_losses(model, documents: list[list[int]]) -> np.ndarray:
    """(D, L): -log p(doc[p] | doc[:p]) for p = 1..L, one forward per prefix."""
    out = np.zeros((len(documents), len(documents[0]) - 1))
    with torch.no_grad():
        for d, doc in enumerate(documents):
            for p in range(1, len(doc)):
                logits = model(torch.tensor([doc[:p]]))[0, -1]
                out[d, p - 1] = -float(logits.log_softmax(-1)[doc[p]])
    return out


def cumulative(losses: np.ndarray) -> np.ndarray:
    """Per position p, the mean over documents of each one's average loss over positions 1..p."""
    return np.array([losses[:, :p].mean(axis=1).mean() for p in range(1, losses.shape[1] + 1)])


def read_csv(path) -> dict[str, np.ndarray]:
    with open(path) as f:
        rows = list(csv.DictReader(f))
    return {key: np.array([float(r[key]) for r in rows]) for key in rows[0]}


def test_eval_nll_matches_the_naive_loss_of_the_first_long_documents(tmp_path, capsys):
    module = small_model(max_seq_len=32)
    run = tmp_path / "run"
    checkpoint = save_checkpoint(module, run / "checkpoints" / "last.ckpt")
    for name, text in TEXTS.items():
        (tmp_path / name).write_text(text)
    files = [str(tmp_path / name) for name in TEXTS]
    code, out = run_eval(["nll", str(checkpoint), "--text-file", *files, "--documents", "3", "--context-len", "16",
                          "--batch-size", "2", "--device", "cpu"], capsys)
    assert code == 0, out
    # the first three files of at least 17 bytes, in order (short.txt is passed over), cut to 17 bytes
    documents = [list(TEXTS[name].encode())[:17] for name in ("a.txt", "b.txt", "c.txt")]
    losses = naive_losses(module.model.eval(), documents)
    per_position, cumulative_nll = losses.mean(axis=0), cumulative(losses)
    written = read_csv(run / "eval" / "nll-ctx16.csv")
    assert written["position"].tolist() == list(range(1, 17))
    assert np.allclose(written["nll"], per_position, atol=1e-5)
    assert np.allclose(written["cumulative_nll"], cumulative_nll, atol=1e-5)
    summary = json.loads((run / "eval" / "nll-ctx16.json").read_text())
    assert summary["documents"] == 3 and [p["position"] for p in summary["positions"]] == [16]
    assert (run / "eval" / "nll-ctx16.png").read_bytes()[:4] == b"\x89PNG"
    events = EventAccumulator(str(run)).Reload()
    assert events.Scalars("nll/ctx16/cumulative_pos16")[0].value == pytest.approx(cumulative_nll[-1], abs=1e-5)
    assert any(line.split()[:1] == ["16"] for line in out.splitlines())  # the printed table's last row

    # fewer long documents than asked: refused before any model is built, naming what is there
    code, out = run_eval(["nll", str(checkpoint), "--text-file", *files, "--documents", "4", "--context-len", "16",
                          "--device", "cpu", "--out", str(tmp_path / "never")], capsys)
    assert code == 2 and "--documents=4 is invalid: only 3 of the 4 documents" in out
    assert not (tmp_path / "never").exists()


def test_eval_nll_reads_the_checkpoint_validation_documents_by_default(tmp_path, capsys):
    checkpoint, data = bpe_text_checkpoint(tmp_path)
    code, out = run_eval(["nll", str(checkpoint), "--documents", "2", "--device", "cpu"], capsys)
    assert code == 0, out
    assert "2 documents of the validation split of stdlib, context 32 tokens" in out  # data.seq_len=32
    # the first two held-out documents of at least 33 BPE tokens, cut to 33
    encoded = (data.tokenizer.encode(text) for text in data.splits()["val"])
    documents = [ids[:33] for ids in encoded if len(ids) >= 33][:2]
    model = load_model(load_checkpoint(str(checkpoint))[0], str(checkpoint), "cpu").model
    written = read_csv(tmp_path / "run" / "eval" / "nll-ctx32.csv")
    assert np.allclose(written["cumulative_nll"], cumulative(naive_losses(model, documents)), atol=1e-5)
