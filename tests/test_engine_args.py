"""The engine flags: speculative decoding's three options (method, draft model, K) parse into one
valid config, reach `launch`'s workers, and a prefill worker runs without them."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from kvservice.client import launch
from kvservice.config import DEFAULT_PROMPT_LOOKUP_MAX, DEFAULT_PROMPT_LOOKUP_MIN
from kvservice.runtime.engine_args import add_engine_arguments, engine_argv, engine_config
from kvservice.server import worker_server


def _engine_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    return parser.parse_args(list(argv))


def test_ngram_flags_parse_into_an_ngram_config() -> None:
    config = engine_config(_engine_args("--speculative-method", "ngram", "--num-speculative-tokens", "3"))
    assert (config.speculative_method, config.num_speculative_tokens, config.draft_model) == ("ngram", 3, None)
    assert (config.prompt_lookup_max, config.prompt_lookup_min) == (
        DEFAULT_PROMPT_LOOKUP_MAX,
        DEFAULT_PROMPT_LOOKUP_MIN,
    )
    tuned = engine_config(
        _engine_args("--speculative-method", "ngram", "--num-speculative-tokens", "5", "--prompt-lookup-min", "1")
    )
    assert (tuned.num_speculative_tokens, tuned.prompt_lookup_min) == (5, 1)


def test_a_draft_model_alone_implies_the_draft_method() -> None:
    config = engine_config(_engine_args("--draft-model", "tiny", "--num-speculative-tokens", "2"))
    assert (config.speculative_method, config.draft_model) == ("draft", "tiny")
    assert engine_config(_engine_args()).speculative_method is None  # off by default


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--speculative-method", "ngram"], "num_speculative_tokens > 0"),
        (["--num-speculative-tokens", "3"], "needs a speculative_method"),
        (["--speculative-method", "ngram", "--num-speculative-tokens", "3", "--draft-model", "tiny"], "draft_model"),
    ],
)
def test_speculative_flags_that_disagree_fail_naming_the_field(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        engine_config(_engine_args(*argv))


def test_an_unknown_method_is_refused_by_the_parser(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _engine_args("--speculative-method", "eagle", "--num-speculative-tokens", "3")
    assert "invalid choice: 'eagle'" in capsys.readouterr().err


def test_launch_hands_the_ngram_flags_to_every_worker_and_prefill_workers_drop_them() -> None:
    parser = argparse.ArgumentParser()
    launch.add_arguments(parser)
    args = parser.parse_args(["--speculative-method", "ngram", "--num-speculative-tokens", "3"])
    argv = engine_argv(args)
    assert argv[argv.index("--speculative-method") + 1] == "ngram"

    def worker_config(role: str) -> object:
        worker = argparse.ArgumentParser()
        worker_server.add_arguments(worker)
        return worker_server.engine_config(worker.parse_args(["--role", role, *argv]))

    decode = worker_config("decode")
    assert decode == dataclasses.replace(engine_config(args), prompt_lane=False)
    prefill = worker_config("prefill")
    assert dataclasses.replace(prefill, prompt_lane=False) == dataclasses.replace(
        decode, speculative_method=None, num_speculative_tokens=0
    )
