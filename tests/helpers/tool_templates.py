"""Chat templates that know tools, written for these tests in the two conventions' styles: a ChatML
one that lists the tools in the system turn, writes calls as <tool_call> blocks (arguments through
`tojson`, as Hugging Face templates do) and hands results back in a user turn, as Qwen2.5's does;
and a Llama-3.1-style one that sends results as `ipython` turns."""

HERMES_STYLE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{{ message.content }}
{%- for call in message.tool_calls or [] %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

LLAMA31_STYLE = """\
{%- for message in messages %}
{%- if message.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- elif message.tool_calls %}<|start_header_id|>assistant<|end_header_id|>

<|python_tag|>{{ message.tool_calls[0].function | tojson }}<|eot_id|>
{%- else %}<|start_header_id|>{{ message.role }}<|end_header_id|>

{% if tools and message.role == 'user' and loop.last %}{% for tool in tools %}{{ tool | tojson }}
{% endfor %}{% endif %}{{ message.content }}<|eot_id|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""
