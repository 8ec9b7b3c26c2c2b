"""ByteDance Seed-OSS's tool calls (vLLM's `seed_oss`): Qwen3-Coder's function and parameter
tags inside `<seed:tool_call>` ... `</seed:tool_call>`, values typed by the request's tool
schema the same way (`qwen3_coder`):

    <seed:tool_call>
    <function=get_weather>
    <parameter=city>Paris</parameter>
    </function>
    </seed:tool_call>
"""

from __future__ import annotations

from ksana_llm.server.tool_parsers.qwen3_coder import Qwen3CoderToolParser, coder_markup


class SeedOssToolParser(Qwen3CoderToolParser):
    name = "seed_oss"
    call_start = "<seed:tool_call>"
    markup = coder_markup("</seed:tool_call>")
