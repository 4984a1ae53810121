"""prl.orchestrator.tokens.TokenClient.tokenize: the server's rendering of a prompt is asked once per
distinct request, also when a group's rollouts ask for it at the same moment."""

import asyncio

import pydantic
import pytest

import verifiers as vf

from prl.orchestrator.tokens import RouteAnswer, Template, TokenClient

PLAIN = Template({}, None)
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {}}}]


class Server:
    """Stands in for the inference server's /tokenize: counts the requests, answers after a pause."""

    def __init__(self, fail_first: int = 0):
        self.bodies, self.fail_first = [], fail_first

    async def post(self, path, body):
        assert path == "/tokenize"
        self.bodies.append(body)
        await asyncio.sleep(0.01)
        if len(self.bodies) <= self.fail_first:
            raise ConnectionError("server gone")
        return {"tokens": [len(m["content"]) for m in body["messages"]] + [int(body["add_generation_prompt"])]}


def client(server: Server) -> TokenClient:
    c = TokenClient.__new__(TokenClient)  # no OpenAI client behind it: only `server` is used here
    c._tokenized, c._end_of_turn = {}, {}
    c.__dict__["server"] = server
    return c


def test_a_groups_prompt_is_rendered_once_and_each_rollout_gets_its_own_list():
    server = Server()
    c = client(server)
    prompt = [{"role": "user", "content": "abc"}]

    async def group():
        return await asyncio.gather(*(c.tokenize(prompt, PLAIN, True) for _ in range(8)),
                                    c.tokenize(prompt, PLAIN, False), c.tokenize(prompt, Template({"think": False}, None), True),
                                    c.tokenize([{"role": "user", "content": "abcd"}], PLAIN, True),
                                    c.tokenize(prompt, Template({}, TOOLS), True))

    out = asyncio.run(group())
    assert out[:8] == [[3, 1]] * 8 and out[8] == [3, 0] and out[9] == [3, 1] and out[10] == [4, 1] and out[11] == [3, 1]
    assert len({id(x) for x in out[:8]}) == 8  # a caller that appends to its ids changes no other's
    assert len(server.bodies) == 5, server.bodies
    assert server.bodies[-1]["tools"] == TOOLS and "tools" not in server.bodies[0]  # rendered with the tools
    assert asyncio.run(c.tokenize(prompt, PLAIN, True)) == [3, 1]  # a later event loop: asked again
    assert len(server.bodies) == 6


def test_a_failed_rendering_is_asked_again_not_remembered():
    server = Server(fail_first=1)
    c = client(server)
    prompt = [{"role": "user", "content": "abc"}]
    with pytest.raises(ConnectionError):
        asyncio.run(c.tokenize(prompt, PLAIN, True))

    async def again():
        return await c.tokenize(prompt, PLAIN, True)

    assert asyncio.run(again()) == [3, 1] and len(server.bodies) == 2


def test_the_tokenizer_loads_with_the_client_once_per_process(tiny_model):
    """The first completion's decode no longer imports transformers and reads the tokenizer: the client
    loads it when it is made (before the orchestrator waits for its servers), once for all the
    clients of one path (one per server)."""
    from openai import AsyncOpenAI

    from prl.orchestrator.tokens import load_tokenizer

    openai = AsyncOpenAI(base_url="http://127.0.0.1:9/v1", api_key="x")  # never asked: nothing is sent
    loads = load_tokenizer.cache_info().misses
    first, second = TokenClient(openai, str(tiny_model)), TokenClient(openai, str(tiny_model))
    assert first.tokenizer is second.tokenizer and load_tokenizer.cache_info().misses <= loads + 1
    ids = first.tokenizer.encode("hello world")
    response = first.to_response(RouteAnswer({"token_ids": ids, "finish_reason": "length", "logprobs": None}, [1, 2], "m"))
    assert response.message.content == first.tokenizer.decode(ids, skip_special_tokens=True) != ""


@pytest.mark.parametrize("result", [
    {"token_ids": [5, 6, 7], "finish_reason": "length", "logprobs": [-0.5, -1.0, -2.25]},
    {"token_ids": [5, 6, 7], "finish_reason": "stop", "logprobs": None},  # the trainer recomputes them
    {"token_ids": [], "finish_reason": "stop", "logprobs": []},  # an empty answer stays a rollout
    {"token_ids": [9], "finish_reason": "abort", "logprobs": [-0.1]},  # no reason verifiers knows
    {"token_ids": [9], "finish_reason": None, "logprobs": [-0.1]},
])
def test_the_routes_answer_becomes_what_verifiers_makes_of_its_chat_completion(tiny_model, result):
    """to_response builds verifiers' Response from the route's lists directly; verifiers made the same
    from the ChatCompletion the route's answer used to go through (one object per token between)."""
    from openai import AsyncOpenAI

    client = TokenClient(AsyncOpenAI(base_url="http://127.0.0.1:9/v1", api_key="x"), str(tiny_model))
    answer = RouteAnswer(result, [1, 2, 3, 4], "m")
    asyncio.run(client.raise_from_native_response(answer))  # accepted as it is, empty too

    def made(convert) -> object:  # the Response's fields, or the error's type
        try:
            return asyncio.run(convert()).model_dump()
        except Exception as e:  # compared below: both ways must fail alike
            return type(e)

    direct = made(lambda: client.from_native_response(answer))
    via_verifiers = made(lambda: vf.OpenAIChatCompletionsClient.from_native_response(client, client.to_chat_completion(answer)))
    assert direct == via_verifiers
    assert (direct is pydantic.ValidationError) == (result["finish_reason"] == "abort")  # vLLM's abort: the rollout errs


def test_a_tokenizer_that_does_not_load_stops_the_client_being_made(tmp_path):
    """A path without a tokenizer fails before any rollout is sent, in one line naming the key and
    the path, and is not remembered as loaded."""
    from openai import AsyncOpenAI

    openai = AsyncOpenAI(base_url="http://127.0.0.1:9/v1", api_key="x")
    for _ in range(2):  # the failure is not cached: asked again, it is tried again
        with pytest.raises(RuntimeError, match=f"model.name's tokenizer, which did not load from {tmp_path}: ValueError"):
            TokenClient(openai, str(tmp_path))  # an empty directory
