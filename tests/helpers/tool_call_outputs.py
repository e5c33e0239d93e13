"""Model outputs of each tool-call form, as the models wrote them.

Hermes and Llama 3.1 outputs are the examples their publishers give (Qwen's function-calling guide
for Qwen2.5, Meta's Llama 3.1 model card); the SmolLM2 ones were recorded from the embedded model
served by specserve (greedy, CPU), under each tool_choice.
"""

QWEN25_TWO_CALLS = (
    '<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": "San Francisco, '
    'CA, USA"}}\n</tool_call>\n<tool_call>\n{"name": "get_temperature_date", "arguments": '
    '{"location": "San Francisco, CA, USA", "date": "2024-10-01"}}\n</tool_call>')
QWEN25_NAMES = frozenset({"get_current_temperature", "get_temperature_date"})

LLAMA31_TAGGED = ('<|python_tag|>{"name": "get_current_conditions", "parameters": {"location": '
                  '"San Francisco, CA", "unit": "Fahrenheit"}}')
# the same call once the detokenizer has dropped the special token
LLAMA31_PLAIN = ('{"name": "get_current_conditions", "parameters": {"location": "San Francisco, '
                 'CA", "unit": "Fahrenheit"}}')
LLAMA31_NAMES = frozenset({"get_current_conditions"})

# tool_choice "required", parallel calls allowed, cut by max_tokens inside the second call
SMOLLM2_REQUIRED_CUT = ('<tool_call>\n{"name": "get_weather", "arguments": {\n    "city": "Paris"'
                        '\n}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {\n'
                        '    "city": "Paris"')
# tool_choice "auto" after a failed result: a call
SMOLLM2_AUTO_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
# tool_choice "auto": a block that is not JSON, which stays the model's text
SMOLLM2_AUTO_BROKEN = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "sky": '
                       '"sunny", "celsius": 21}}, "temperature": 21}')
SMOLLM2_NAMES = frozenset({"get_weather"})
