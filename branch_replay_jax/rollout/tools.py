"""Tools an agent calls, and the JSON tool-call format (docs/design.md, "Episodes").

    <tool_call>{"name": "calculator", "arguments": {"expression": "17 * 3"}}</tool_call>

A call is a JSON object (or a JSON list of them, SmolLM2's function-calling format) between
<tool_call> tags in the model's turn, read as JSON from the opening tag, so a string inside it may
hold the text "</tool_call>" (the Hermes parser's fault, vLLM #45167); "arguments" is an object, an
object encoded as a JSON string (OpenAI's format), or "" for none. The tools' JSON schemas are listed in the system prompt
(`tools_system_prompt`). `calculate` evaluates arithmetic with a restricted `ast` walk: numbers,
+ - * / // % ** and parentheses only; never `eval`.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import math
import operator
from typing import Any, Callable, Mapping, Sequence

from branch_replay_jax.rollout.tasks.prompts import extract_answer

OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"
_JSON = json.JSONDecoder()


class ToolCallError(ValueError):
  """A tool call that does not parse: unclosed tags, not JSON, no tool name, an unknown tool, or
  arguments that are not a JSON object."""


class ToolError(ValueError):
  """A tool that refused its arguments or failed on them (e.g. division by zero)."""


@dataclasses.dataclass(frozen=True)
class Tool:
  """A callable tool: `fn(**arguments) -> str` (raising `ToolError`), with its JSON schema.

  name: the name a call uses; description: one line for the system prompt; parameters: a JSON
  schema object of the arguments (https://json-schema.org), as in OpenAI's function tools.
  """
  name: str
  description: str
  parameters: dict
  fn: Callable[..., str]

  def schema(self) -> dict:
    """{"type": "function", "function": {name, description, parameters}} (OpenAI's tool format)."""
    return {"type": "function", "function": {"name": self.name, "description": self.description,
                                             "parameters": self.parameters}}


@dataclasses.dataclass(frozen=True)
class ToolCall:
  name: str
  arguments: dict


def _skip_space(text: str, pos: int) -> int:
  while pos < len(text) and text[pos].isspace():
    pos += 1
  return pos


def _call_values(text: str) -> list:
  """The JSON value of each <tool_call>, in order: decoded from just after the opening tag to the end
  of its value, which must be followed (whitespace aside) by the closing tag."""
  values, pos = [], 0
  while (start := text.find(OPEN_TAG, pos)) >= 0:
    i, body = len(values), _skip_space(text, start + len(OPEN_TAG))
    close = text.find(CLOSE_TAG, body)
    if close < 0:
      raise ToolCallError(f"tool call {i}: a <tool_call> is not closed by </tool_call>")
    try:
      value, end = _JSON.raw_decode(text, body)
    except json.JSONDecodeError as e:
      raise ToolCallError(f"tool call {i} is not JSON ({e.msg} at character {e.pos - body}): "
                          f"{text[body:close].strip()[:80]!r}") from e
    except RecursionError:   # a degenerate turn: "[[[[..." nested past Python's recursion limit
      raise ToolCallError(f"tool call {i}: its JSON is nested too deeply to read") from None
    end = _skip_space(text, end)
    if not text.startswith(CLOSE_TAG, end):
      after = text.find(CLOSE_TAG, end)
      raise ToolCallError(f"tool call {i}: {text[end:after][:40]!r} follows its JSON instead of </tool_call>"
                          if after >= 0 else f"tool call {i}: a <tool_call> is not closed by </tool_call>")
    values.append(value)
    pos = end + len(CLOSE_TAG)
  return values


def _arguments(i: int, arguments) -> dict:
  """A call's arguments: an object; an object encoded as a JSON string (OpenAI's `function.arguments`);
  "" (or only whitespace) for none."""
  if isinstance(arguments, str):
    if not arguments.strip():
      return {}
    try:
      arguments = json.loads(arguments)
    except json.JSONDecodeError:
      raise ToolCallError(f"tool call {i}: the string \"arguments\" is not JSON: {arguments[:80]!r}") from None
  if not isinstance(arguments, dict):
    raise ToolCallError(f"tool call {i}: \"arguments\" must be a JSON object, got {json.dumps(arguments)[:80]}")
  return arguments


def parse_tool_calls(text: str, tools: Mapping[str, Any]) -> list[ToolCall]:
  """The tool calls in a model turn, in order; [] when it has none (a final answer). `tools`' keys are the
  names a call may use (its values, `Tool`s or schemas, are not read).

  Raises:
    ToolCallError: an unclosed <tool_call>, a call that is not JSON (or text between its JSON and
      </tool_call>), not an object (or a list of objects) with a string "name" of one of `tools`,
      arguments that are neither an object nor a string encoding one; the message names the call's
      index and what is wrong.
  """
  calls = []
  for i, value in enumerate(_call_values(text)):
    if value == []:
      raise ToolCallError(f"tool call {i} is an empty list: no call")
    for item in value if isinstance(value, list) else [value]:
      if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        raise ToolCallError(f"tool call {i} must be an object with a string \"name\", got {json.dumps(item)[:80]}")
      if item["name"] not in tools:
        raise ToolCallError(f"tool call {i} names tool {item['name']!r}; the tools are {sorted(tools)}")
      calls.append(ToolCall(item["name"], _arguments(i, item.get("arguments", {}))))
  return calls


def call_tool(tool: Tool, call: ToolCall) -> str:
  """tool.fn(**call.arguments).

  Raises:
    ToolCallError: arguments the tool does not take (or missing ones).
    ToolError: the tool's own refusal or failure.
  """
  required = tool.parameters.get("required", [])
  known = tool.parameters.get("properties", {})
  missing, unknown = [k for k in required if k not in call.arguments], [k for k in call.arguments if k not in known]
  if missing or unknown:
    raise ToolCallError(f"tool {tool.name!r}: missing arguments {missing}, unknown arguments {unknown}")
  return tool.fn(**call.arguments)


def tools_system_prompt(tools: Sequence[Tool]) -> str:
  """The system message that lists the tools' schemas and the call format."""
  return schemas_system_prompt([t.schema() for t in tools])


def schemas_system_prompt(schemas: Sequence[dict]) -> str:
  """`tools_system_prompt` of tools known by their schemas only ({"type": "function", "function": {name,
  description, parameters}}, `Tool.schema`'s format): an MCP server's (rollout/openenv_env.py)."""
  listed = "\n".join(json.dumps(schema) for schema in schemas)
  return ("You can call tools. Their JSON schemas:\n<tools>\n" + listed + "\n</tools>\n"
          "To call one, write <tool_call>{\"name\": NAME, \"arguments\": {...}}</tool_call> and stop; the result "
          "comes back in a tool message. When you know the answer, write it without a tool call.")


# ---- the calculator: a restricted ast evaluator ------------------------------------------------------

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPRESSION_CHARS = 200
MAX_MAGNITUDE = 10 ** 30    # results and operands beyond it are refused (no huge powers)
MAX_EXPONENT = 64


def _evaluate(node: ast.AST) -> int | float:
  if isinstance(node, ast.Expression):
    return _evaluate(node.body)
  if isinstance(node, ast.Constant) and type(node.value) in (int, float):
    value = node.value
  elif isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
    value = _UNARY[type(node.op)](_evaluate(node.operand))
  elif isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
    left, right = _evaluate(node.left), _evaluate(node.right)
    if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
      raise ToolError(f"exponent {right} is beyond ±{MAX_EXPONENT}")
    try:
      value = _BINARY[type(node.op)](left, right)
    except ZeroDivisionError:
      raise ToolError("division by zero") from None
    except OverflowError:
      raise ToolError("the result overflows") from None
    if isinstance(value, complex):
      raise ToolError("the result is not a real number")
  else:
    raise ToolError(f"{type(node).__name__} is not allowed: only numbers, + - * / // % ** and parentheses")
  if (isinstance(value, float) and not math.isfinite(value)) or abs(value) > MAX_MAGNITUDE:
    raise ToolError("the result's magnitude is beyond 1e30")
  return value


def calculate(expression: str) -> str:
  """Evaluate an arithmetic expression: numbers, + - * / // % ** (exponent within ±64), unary ± and
  parentheses; anything else (names, calls, attributes, strings) is refused. Never `eval`.

  Returns:
    The value as text: an integer without a decimal point ("1024"; also an integer-valued float,
    "6 / 2" -> "3"), else up to 12 significant digits ("7 / 2" -> "3.5").

  Raises:
    ToolError: a non-string or too long expression, a syntax error, a disallowed construct,
      division by zero, a result beyond 1e30 in magnitude, or a complex result.
  """
  if not isinstance(expression, str):
    raise ToolError(f"expression must be a string, got {type(expression).__name__}")
  if len(expression) > MAX_EXPRESSION_CHARS:
    raise ToolError(f"expression of {len(expression)} characters is longer than {MAX_EXPRESSION_CHARS}")
  try:
    tree = ast.parse(expression.strip(), mode="eval")
  except SyntaxError as e:
    raise ToolError(f"not an arithmetic expression: {e.msg}") from None
  value = _evaluate(tree)
  if isinstance(value, float) and value.is_integer():
    value = int(value)
  return str(value) if isinstance(value, int) else format(value, ".12g")


CALCULATOR = Tool("calculator", "Evaluates an arithmetic expression with + - * / // % ** and parentheses.",
                  {"type": "object", "properties": {"expression": {"type": "string",
                                                                   "description": "e.g. (17 + 25) * 3"}},
                   "required": ["expression"]}, calculate)


TURN_FORMATS = ("tool_call", "answer", "malformed_tool_call", "no_format")


def turn_format(text: str, tools: Mapping[str, Tool]) -> str:
  """What a model turn's text is: "tool_call" (>= 1 call that parses, `parse_tool_calls`), "answer"
  (no call and a closed, non-blank <answer> tag, `rollout.tasks.prompts.extract_answer` strict),
  "malformed_tool_call" (a call that does not parse) or "no_format" (neither). The first two are the
  formats the tools' system prompt asks for: a step's format rate is their share of its turns."""
  try:
    calls = parse_tool_calls(text, tools)
  except ToolCallError:
    return "malformed_tool_call"
  if calls:
    return "tool_call"
  return "answer" if extract_answer(text, strict=True)[0] is not None else "no_format"


def tool_table(tools: Sequence[Tool]) -> dict[str, Any]:
  """{name: tool}; raises ValueError on two tools of one name."""
  table = {t.name: t for t in tools}
  if len(table) != len(tools):
    raise ValueError(f"tool_table: tool names repeat: {[t.name for t in tools]}")
  return table
