"""The system message of an agent's rows: an instruction, then rl360's tool descriptions in the layout Qwen's
chat template gives them (a `# Tools` block of JSON schemas in `<tools>` tags and the `<tool_call>` format), so
a model that was taught Qwen's function calling sees its usual prompt and calls the tools by rl360's names."""

from __future__ import annotations

import json

from rl360.agents.tools import build_tools, tool_schemas


def tools_system_prompt(instruction: str, tools: list[str]) -> str:
    """`instruction` followed by the tools block for the built-in `tools` (e.g. ["image_zoom_in"])."""
    schemas = "\n".join(json.dumps(schema, ensure_ascii=False) for schema in tool_schemas(build_tools(tools)))
    return (f"{instruction}\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{schemas}\n"
            "</tools>\n\nFor each function call, return a json object with function name and arguments within "
            "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
            "<args-json-object>}\n</tool_call>")
