"""OpenAI function calling: the request's tools and tool_choice checked, the conversation rendered
for the chat template, calls that tool_choice demands enforced by a grammar, and calls parsed from
the model's text, whole or streamed. See README "Function calling"."""
