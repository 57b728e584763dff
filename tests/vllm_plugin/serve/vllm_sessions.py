"""vLLM's streaming-input sessions beside plain requests, with prefix caching on: the workload
the plugin's tests run on every vLLM release (test_vllm_sessions.py).

    python tests/vllm_plugin/serve/vllm_sessions.py MODEL [--flip]

A session is one ``AsyncLLM.generate`` over an async generator of ``StreamingInput`` chunks
(a resumable request): vLLM keeps the session's KV between chunks, drops the last token it
sampled for a chunk, and appends the next chunk's prompt to what it computed. Here each
session's first chunk and each plain request start with one shared prefix of `PREFIX`
tokens, so they hit the prefix cache; a session yields its next chunk only once the
previous one has answered, so it pauses holding its blocks in between. With ``--flip`` a
bit of a slot of session 0's first chunk (a token only that session holds at that
position) is flipped while it pauses, through a worker method of the tests' flip plugin
(`vllm_serve.FLIP_PLUGIN`, on the PYTHONPATH): its next chunk reads the flipped slot.

AsyncLLM runs its engine core in a process of its own, whose log (and the canary's lines
in it) goes to this process's stdout; the last line this prints is a JSON summary: each
session's tokens by chunk, each plain request's tokens and cached prompt tokens, and the
flipped slot.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random

# Tokens every session's first chunk and every plain request starts with: two blocks.
PREFIX = 64
BLOCK_SIZE = 32
SESSIONS = 3
# Prompt tokens of each session's chunks after the shared prefix (the first chunk's own).
CHUNK_PROMPTS = (40, 20, 24)
PLAIN = 4
TOKENS_PER_CHUNK = 6
# The position of the slot of session 0 that ``--flip`` flips: in its own tokens after the prefix.
FLIP_POSITION = PREFIX + 5


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(2, 512) for _ in range(n)]


def workload(seed: int = 0) -> tuple[list[list[list[int]]], list[list[int]]]:
    """Each session's chunk prompts and each plain request's prompt. Session 0's token at
    `FLIP_POSITION` is one no other prompt has there, so that one slot holds it."""
    rng = random.Random(seed)
    prefix = _tokens(rng, PREFIX)
    sessions = [[prefix + _tokens(rng, CHUNK_PROMPTS[0])] + [_tokens(rng, n) for n in CHUNK_PROMPTS[1:]] for _ in range(SESSIONS)]
    plain = [prefix + _tokens(rng, 50 + 7 * i) for i in range(PLAIN)]
    others = {prompt[FLIP_POSITION] for prompt in [chunks[0] for chunks in sessions[1:]] + plain}
    sessions[0][0][FLIP_POSITION] = min(set(range(2, 512)) - others)
    return sessions, plain


def _sampling_params():
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(max_tokens=TOKENS_PER_CHUNK, temperature=0.0, ignore_eos=True, output_kind=RequestOutputKind.DELTA)


async def _session(engine, name: str, chunks: list[list[int]], paused) -> list[list[int]]:
    """Runs session ``name`` over ``chunks``; awaits ``paused(index)`` after chunk ``index``
    answered, before the next is sent. Each chunk's tokens."""
    from vllm.engine.protocol import StreamingInput
    from vllm.inputs import TokensPrompt

    answered = [asyncio.Event() for _ in chunks]

    async def inputs():
        for index, prompt in enumerate(chunks):
            yield StreamingInput(prompt=TokensPrompt(prompt_token_ids=prompt))
            await answered[index].wait()
            await paused(index)

    tokens: list[list[int]] = [[]]
    async for output in engine.generate(inputs(), _sampling_params(), name):
        completion = output.outputs[0]
        tokens[-1].extend(completion.token_ids)
        if completion.finish_reason is not None and len(tokens) <= len(chunks):
            answered[len(tokens) - 1].set()
            tokens.append([])
    return [chunk for chunk in tokens if chunk]


async def _plain(engine, name: str, prompt: list[int]) -> dict:
    from vllm.inputs import TokensPrompt

    tokens, cached = [], None
    async for output in engine.generate(TokensPrompt(prompt_token_ids=prompt), _sampling_params(), name):
        tokens.extend(output.outputs[0].token_ids)
        cached = output.num_cached_tokens if output.num_cached_tokens is not None else cached
    return {"tokens": tokens, "cached": cached}


async def run(model: str, flip: bool) -> dict:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    args = AsyncEngineArgs(
        model=model,
        dtype="bfloat16",
        max_model_len=512,
        block_size=BLOCK_SIZE,
        kv_cache_memory_bytes=4 << 20,
        enforce_eager=True,
        enable_prefix_caching=True,
        enable_chunked_prefill=True,
        max_num_batched_tokens=64,
        max_num_seqs=8,
    )
    engine = AsyncLLM.from_engine_args(args)
    sessions, plain = workload()
    flipped = {}

    async def pause(index: int) -> None:
        await asyncio.sleep(0.2)  # the session waits for its next chunk, holding its blocks

    async def pause_and_flip(index: int) -> None:
        if index == 0:
            token = sessions[0][0][FLIP_POSITION]
            (flipped["slot"],) = set(await engine.collective_rpc("kvcanary_test_flip", args=(str(token), str(FLIP_POSITION))))
        await pause(index)

    try:
        # The sessions' first chunks compute the prefix; the plain requests come after and hit it.
        session_tasks = [
            asyncio.create_task(_session(engine, f"session-{i}", chunks, pause_and_flip if flip and i == 0 else pause))
            for i, chunks in enumerate(sessions)
        ]
        await asyncio.sleep(1.0)
        answers = await asyncio.gather(*(_plain(engine, f"plain-{i}", prompt) for i, prompt in enumerate(plain)))
        return {"sessions": await asyncio.gather(*session_tasks), "plain": answers, "flipped": flipped}
    finally:
        engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--flip", action="store_true", help="flip a bit of session 0's KV while it pauses after its first chunk")
    options = parser.parse_args()
    summary = asyncio.run(run(options.model, options.flip))
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
