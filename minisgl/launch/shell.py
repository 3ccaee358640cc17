"""`python -m minisgl.serve --shell`: chat with the model in the terminal, answers streamed.

The history is sent whole each turn; the prefix cache makes that cheap. The sampling
settings start as the server's defaults (the model's recommended ones, see
models/sampling_defaults.py), are printed at the start and by /show, and change with
`/set temperature 0`. /reset clears the history, /exit (or Ctrl-D) quits, Ctrl-C stops the
answer being written.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import threading
from typing import Any

from minisgl.core.sampling_params import RequestError, SamplingParams, checked_sampling
from minisgl.message import TokenizeMsg
from minisgl.models.sampling_defaults import OPENAI_DEFAULTS
from minisgl.server.frontend import Frontend

# What /set takes, with the type of its value; "none" unsets the optional ones.
SETTABLE: dict[str, type] = {
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "min_p": float,
    "repetition_penalty": float,
    "presence_penalty": float,
    "frequency_penalty": float,
    "max_tokens": int,
    "seed": int,
}
HELP = (
    "commands: /set FIELD VALUE (e.g. /set temperature 0), /show, /reset (clear the history), /help, /exit\n"
    f"fields: {', '.join(SETTABLE)}"
)


class Settings:
    """The sampling fields in force for the shell's requests."""

    def __init__(self, defaults: dict[str, Any]) -> None:
        self.values: dict[str, Any] = {**OPENAI_DEFAULTS, **defaults, "max_tokens": None, "seed": None}

    def show(self) -> str:
        return "sampling: " + ", ".join(f"{k}={v}" for k, v in self.values.items() if v is not None or k in SETTABLE)

    def set(self, name: str, text: str) -> str:
        """Applies `/set name text`; returns what to print."""
        if name not in SETTABLE:
            return f"unknown field {name!r}; " + HELP.splitlines()[1]
        try:
            value = None if text.lower() == "none" else SETTABLE[name](text)
        except ValueError:
            return f"{name}: {text!r} is not a {SETTABLE[name].__name__}"
        if value is None and name not in ("max_tokens", "seed"):
            return f"{name} cannot be unset"
        trial = {**self.values, name: value}
        try:
            checked_sampling(trial)
        except RequestError as e:
            return f"error: {e}"
        self.values = trial
        return self.show()


class _LineReader:
    """prompt_toolkit on a terminal (editing, history); plain lines from a pipe otherwise,
    read on a daemon thread so a blocked read never holds up exit."""

    def __init__(self) -> None:
        self.session: Any = None
        if sys.stdin.isatty():
            from prompt_toolkit import PromptSession

            self.session = PromptSession()
        else:
            loop = asyncio.get_running_loop()
            self.lines: asyncio.Queue[str | None] = asyncio.Queue()

            def pump() -> None:
                for line in sys.stdin:
                    loop.call_soon_threadsafe(self.lines.put_nowait, line.rstrip("\n"))
                loop.call_soon_threadsafe(self.lines.put_nowait, None)

            threading.Thread(target=pump, daemon=True).start()

    async def read(self, prompt: str) -> str | None:
        """A line, or None at end of input."""
        if self.session is None:
            print(prompt, end="", flush=True)
            return await self.lines.get()
        while True:
            try:
                return await self.session.prompt_async(prompt)
            except KeyboardInterrupt:
                continue  # Ctrl-C at the prompt clears the line
            except EOFError:
                return None


async def _answer(frontend: Frontend, history: list[dict[str, str]], sampling: SamplingParams) -> str | None:
    """Streams one answer to stdout; None when the request failed."""
    loop = asyncio.get_running_loop()
    interrupted = asyncio.Event()
    loop.add_signal_handler(signal.SIGINT, interrupted.set)
    handle = frontend.submit([TokenizeMsg([0], messages=list(history), sampling=sampling)])
    parts: list[str] = []
    try:
        while not handle.done or not handle.queue.empty():
            get = asyncio.ensure_future(frontend.next_reply(handle))
            stop = asyncio.ensure_future(interrupted.wait())
            done, _ = await asyncio.wait({get, stop}, return_when=asyncio.FIRST_COMPLETED)
            if get not in done:
                get.cancel()
                frontend.abort(handle)
                print(" [stopped]")
                return "".join(parts)
            stop.cancel()
            reply = get.result()
            if reply.error is not None:
                print(f"error: {reply.error}" + (" (try /reset)" if reply.error_param else ""))
                return None
            parts.append(reply.text)
            print(reply.text, end="", flush=True)
        print()
        return "".join(parts)
    finally:
        loop.remove_signal_handler(signal.SIGINT)
        if not handle.done:
            frontend.abort(handle)


async def run_shell(frontend: Frontend, model_name: str, defaults: dict[str, Any]) -> None:
    reader = _LineReader()
    settings = Settings(defaults)
    print(f"minisgl shell: chatting with {model_name}. /help lists the commands, /exit quits.")
    print(settings.show(), flush=True)
    history: list[dict[str, str]] = []
    while True:
        line = await reader.read("> ")
        if line is None or line.strip() == "/exit":
            return
        cmd = line.strip()
        if not cmd:
            continue
        if cmd == "/reset":
            history.clear()
            print("(history cleared)")
            continue
        if cmd == "/show":
            print(settings.show())
            continue
        if cmd.startswith("/set"):
            parts = cmd.split()
            print(settings.set(parts[1], parts[2]) if len(parts) == 3 else "usage: /set FIELD VALUE")
            continue
        if cmd.startswith("/"):
            print(HELP)
            continue
        history.append({"role": "user", "content": line})
        answer = await _answer(frontend, history, checked_sampling(settings.values))
        if answer is None:
            history.pop()
        else:
            history.append({"role": "assistant", "content": answer})
