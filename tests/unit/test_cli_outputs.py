"""The files commands write: checked while the command line is read, written whole or
not at all, and a write that fails after the work is a message, not lost figures."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from tokenfleet.cli import build_parser, main

TRACE = (
    '{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}\n'
    '{"timestamp": 100, "input_length": 600, "output_length": 5, "hash_ids": [1, 3]}\n'
)


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_json_that_cannot_be_written_is_named_after_the_summary_and_the_rest_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace, records = tmp_path / "t.jsonl", tmp_path / "records.csv"
    trace.write_text(TRACE)
    argv = ["sim", "--trace", str(trace), "--instances", "1", "--json", "/dev/full"]
    assert main([*argv, "--records", str(records)]) == 2
    out, err = capsys.readouterr()
    assert "2 of 2 requests" in out  # the summary, printed before the write
    assert err.startswith("tokenfleet: cannot write /dev/full:")
    with records.open() as rows:
        assert len(list(csv.DictReader(rows))) == 2


def test_a_write_that_fails_midway_leaves_the_file_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tokenfleet.commands.errors import CliError
    from tokenfleet.commands.output import write_json

    out = tmp_path / "figures.json"
    out.write_text('{"old": true}\n')
    write_text = Path.write_text

    def full_disk(path: Path, text: str) -> int:
        write_text(path, text[: len(text) // 2])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full_disk)
    with pytest.raises(CliError, match=r"cannot write .*figures\.json: No space left"):
        write_json(out, {"new": list(range(100))})
    monkeypatch.undo()
    assert out.read_text() == '{"old": true}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["figures.json"]  # no temporary left


@pytest.mark.parametrize(
    ("option", "name", "message"),
    [
        ("--step-change", "missing/step.xyz", "matplotlib writes"),
        ("--plot", "levels.docx", "matplotlib writes"),
        ("--step-change", "a-file/step.png", "cannot make the folder"),
    ],
)
def test_a_plot_matplotlib_cannot_write_is_refused_before_the_bench(
    option: str, name: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "a-file").write_text("")
    argv = ["bench", "admission", "--json", str(tmp_path / "b.json"), option, str(tmp_path / name)]
    with pytest.raises(SystemExit) as refused:
        build_parser().parse_args(argv)
    assert refused.value.code == 2
    assert message in capsys.readouterr().err


def test_a_plot_into_a_missing_folder_gets_its_folder(tmp_path: Path) -> None:
    plot = tmp_path / "new" / "step.png"
    argv = ["bench", "admission", "--json", str(tmp_path / "b.json"), "--step-change", str(plot)]
    assert build_parser().parse_args(argv).step_change == plot
    assert plot.parent.is_dir()


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs /proc")
def test_a_folder_no_file_can_be_written_in_is_refused_before_the_run(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as refused:
        build_parser().parse_args(["sim", "--trace", "mooncake", "--json", "/proc/out.json"])
    assert refused.value.code == 2
    assert "cannot write /proc/out.json" in capsys.readouterr().err


def test_a_link_is_written_through_and_a_file_keeps_its_mode(tmp_path: Path) -> None:
    """Replaced, /dev/stdout redirected to a file (a link) became a file holding the
    JSON, and the redirect's file stayed empty."""
    from tokenfleet.commands.output import write_json

    target, link = tmp_path / "redirected.txt", tmp_path / "stdout"
    target.write_text("")
    link.symlink_to(target)
    write_json(link, {"a": 1})
    assert link.is_symlink()
    assert '"a": 1' in target.read_text()
    private = tmp_path / "private.json"
    private.write_text("{}")
    private.chmod(0o600)
    write_json(private, {"b": 2})
    assert (private.stat().st_mode & 0o777, '"b": 2' in private.read_text()) == (0o600, True)


def test_the_demo_s_default_folder_is_made_and_a_plot_without_a_suffix_is_a_png(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default, not a string, was never passed through the folder's check: the demo
    failed to write its figures after the whole run, in a fresh clone."""
    monkeypatch.chdir(tmp_path)
    args = build_parser().parse_args(["demo"])
    assert args.out == Path("out/demo")
    assert (tmp_path / "out" / "demo").is_dir()
    plot = build_parser().parse_args(["bench", "fleet", "--json", "f.json", "--plot", "hot"])
    assert plot.plot == Path("hot.png")  # the temporary file kept no suffix matplotlib knows


def test_a_fleet_run_whose_hotspot_completed_nothing_writes_its_json_and_prints_dashes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The table's None P95 raised after the run, and took its JSON and plot with it."""
    trace = tmp_path / "three.jsonl"
    rows = [
        f'{{"timestamp": {n * 100}, "input_length": 100, "output_length": 5, '
        f'"hash_ids": [{n}], "region": "{region}"}}'
        for n, region in enumerate(("eu-west", "us-east", "ap-south"))
    ]
    trace.write_text("\n".join(rows) + "\n")
    out = tmp_path / "f.json"
    argv = ["bench", "fleet", "--trace", str(trace), "--policies", "local_only", "--json", str(out)]
    assert main(argv) == 0
    assert json.loads(out.read_text())["policies"]["local_only"]["hotspot"]["ttft_p95_s"] is None
    [row] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("local")]
    assert row.split()[3:5] == ["-", "-"]
