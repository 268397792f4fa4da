"""The image-folder walkthrough of docs/streaming.md (the README links it), run as written (issue 37: a converted
image folder trained at chance): its lines between the `walkthrough` markers go to bash unchanged but for two
things a test must not share with other runs: /tmp/ becomes this test's folder and port 9000 a free one."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest

from tests.support.harness import REPO, run_bounded

BEGIN, END = "<!-- walkthrough: begin -->", "<!-- walkthrough: end -->"


def walkthrough_lines(page: str) -> list[str]:
    """The lines of the bash blocks between the markers."""
    section = page.split(BEGIN, 1)[1].split(END, 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    return [line for block in blocks for line in block.splitlines()]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_the_walkthrough_trains_an_image_folder_from_a_directory_and_from_s3(tmp_path: Path) -> None:
    """Over 30 s: it runs the page's lines as written (convert, verify, two 2-rank trainings: from the folder and from
    S3; a messy folder converted in both modes, issue 59)."""
    lines = walkthrough_lines((REPO / "docs" / "streaming.md").read_text())
    assert any("data convert" in line for line in lines) and any("s3://" in line for line in lines), lines
    port = str(free_port())
    script = "\n".join(line.replace("/tmp/", f"{tmp_path}/").replace("9000", port) for line in lines)
    (tmp_path / "walkthrough.sh").write_text("set -euo pipefail\n" + script + "\n")
    res = run_bounded(["bash", str(tmp_path / "walkthrough.sh")], timeout=600, cwd=REPO)
    assert res.returncode == 0, res.describe()
    assert len(re.findall(r"^OK: .*2 split\(s\), 13 shards, 1,000 samples$", res.output, flags=re.M)) == 2, (
        res.describe())
    messy = f"{tmp_path}/messy"  # every bad file in one run; both modes keep the 120 good images, nested ones too
    assert (f"2 image files cannot be converted:\n  {messy}/circle/2024/broken.jpg: does not decode (image file is "
            f"truncated" in res.output and f"\n  {messy}/square/thumb.jpg: not an image Pillow" in res.output), (
        res.describe())
    assert res.output.count("note: skipped 2 bad image files (--skip-bad)") == 2, res.describe()
    assert re.search(r"^OK: .*messy-jpeg: 2 split\(s\), 2 shards, 120 samples$", res.output, flags=re.M), (
        res.describe())
    accuracies = [float(a) for a in re.findall(r"done: 10/10 epochs, validation accuracy ([\d.]+)%", res.output)]
    assert len(accuracies) == 2 and min(accuracies) >= 90, res.describe()
