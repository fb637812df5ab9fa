"""What the command line makes of the environment: a misspelt setting is named, a traces
folder that is not there is a message."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tokenfleet.cli import main


def test_a_misspelt_setting_is_named_with_the_one_meant(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in [n for n in os.environ if n.startswith("TOKENFLEET_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("TOKENFLEET_GATEWAY_ADMISION", "fcfs")
    monkeypatch.setenv("TOKENFLEET_WORKER_WINDOW_S", "30")  # known: no warning
    monkeypatch.setenv("TOKENFLEET_TRACES", str(Path(__file__).parents[2] / "sim/data/traces"))
    assert main(["workload", "list"]) == 0
    warnings = capsys.readouterr().err.splitlines()
    assert warnings == [
        "tokenfleet: warning: TOKENFLEET_GATEWAY_ADMISION is not a setting TokenFleet reads, "
        "ignored (did you mean TOKENFLEET_GATEWAY_ADMISSION?)"
    ]


@pytest.mark.parametrize(
    ("trace", "folder"),
    [
        ("mooncake", "mooncake_fast25/"),
        # a folder that is not there globbed to no client: an empty trace, exit 0
        ("servegen", "servegen/reason/deepseek-r1/chunk-*-trace.csv"),
    ],
)
def test_a_traces_folder_that_is_not_there_is_named_with_exit_2(
    trace: str,
    folder: str,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("TOKENFLEET_TRACES", str(tmp_path / "none"))
    assert main(["sim", "--trace", trace, "--instances", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tokenfleet: trace {trace}: {tmp_path}/none/{folder}")
    assert "TOKENFLEET_TRACES" in err


def test_a_traces_folder_that_is_a_file_or_holds_other_columns_is_named_with_exit_2(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A file in the folder's place was a traceback (NotADirectoryError), as a trace file
    of other columns was (KeyError), or with a row cut short (TypeError); a bad value did
    not name its file, and a file of the header alone exported no request, with exit 0."""
    not_a_folder = tmp_path / "traces"
    not_a_folder.write_text("")
    monkeypatch.setenv("TOKENFLEET_TRACES", str(not_a_folder))
    out = str(tmp_path / "m.csv")
    assert main(["workload", "export", "--trace", "azure-conv", "--out", out]) == 2
    assert "unread: Not a directory" in capsys.readouterr().err
    azure = tmp_path / "other" / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.csv"
    azure.parent.mkdir(parents=True)
    monkeypatch.setenv("TOKENFLEET_TRACES", str(tmp_path / "other"))
    header = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
    for content, message in [
        (header, "trace azure-conv: its files hold no requests"),
        ("a,b,c\n1,2,3\n", f"{azure}: no column {header.strip().replace(',', ', ')} (it has a, b"),
        (f"{header}2023-11-16 18:17:03.97,5\n", f"{azure} line 2: a row cut short"),
        (f"{header}2023-11-16 18:17:03.97,x,5\n", f"{azure} line 2: invalid literal for int()"),
    ]:
        azure.write_text(content)
        assert main(["workload", "export", "--trace", "azure-conv", "--out", out]) == 2
        assert message in capsys.readouterr().err
    assert not Path(out).exists()


def test_a_window_of_no_whole_slides_is_named_as_the_settings_error_it_is(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """recount said the broker it was about to ask refused it."""
    monkeypatch.setenv("TOKENFLEET_KAFKA_BOOTSTRAP", "127.0.0.1:1")  # never reached
    monkeypatch.setenv("TOKENFLEET_WORKER_WINDOW_S", "7")
    assert main(["recount"]) == 2
    err = capsys.readouterr().err
    assert "invalid WorkerSettings (from TOKENFLEET_* environment variables)" in err
    assert "TOKENFLEET_WORKER_WINDOW_S 7, TOKENFLEET_WORKER_SLIDE_S 5: the window size" in err


def test_a_servegen_file_of_another_shape_is_named(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A dataset without a field was a traceback (KeyError)."""
    pool = tmp_path / "servegen" / "reason" / "deepseek-r1"
    pool.mkdir(parents=True)
    (pool / "chunk-1-trace.csv").write_text("0,1.0,1.0,Gamma,1.0,1.0\n")
    dataset = pool / "chunk-1-dataset.json"
    dataset.write_text('{"0": {"input_tokens": "{10: 1.0}"}}')
    monkeypatch.setenv("TOKENFLEET_TRACES", str(tmp_path))
    out = str(tmp_path / "m.csv")
    assert main(["workload", "export", "--trace", "servegen", "--out", out]) == 2
    err = capsys.readouterr().err
    assert f"{dataset}: not a ServeGen dataset (KeyError('output_tokens'))" in err
