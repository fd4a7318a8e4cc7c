//! The OpenAPI description of the routes (`GET /openapi.json`), for clients and for schema-driven
//! testing. Kept by hand next to `routes`; the shapes are OpenAI's.

pub const SPEC: &str = r##"{
  "openapi": "3.0.3",
  "info": {"title": "fsdp-app serve", "version": "0.1.0", "description": "OpenAI-compatible generation API. Request fields not listed here are refused with 400 naming them (param), unless the server runs with --lenient, which ignores them and lists them in the x-fsdp-app-ignored-params response header."},
  "components": {
    "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
    "schemas": {
      "Error": {"type": "object", "required": ["error"], "properties": {"error": {"type": "object", "required": ["message", "type"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"}, "param": {"type": "string", "nullable": true}, "code": {"type": "string", "nullable": true}}}}},
      "Sampling": {"type": "object", "properties": {
        "max_tokens": {"type": "integer", "minimum": 1}, "temperature": {"type": "number", "minimum": 0, "maximum": 2},
        "top_p": {"type": "number", "exclusiveMinimum": true, "minimum": 0, "maximum": 1}, "top_k": {"type": "integer", "minimum": -1},
        "min_p": {"type": "number", "minimum": 0, "maximum": 1}, "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
        "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2}, "repetition_penalty": {"type": "number", "exclusiveMinimum": true, "minimum": 0, "maximum": 10},
        "seed": {"type": "integer"}, "n": {"type": "integer", "minimum": 1, "maximum": 8}, "stream": {"type": "boolean"},
        "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
        "stop": {"oneOf": [{"type": "string", "minLength": 1}, {"type": "array", "maxItems": 4, "items": {"type": "string", "minLength": 1}}]},
        "logit_bias": {"type": "object", "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}},
        "user": {"type": "string"},
        "ignore_eos": {"type": "boolean", "description": "vLLM's: go on past eos tokens."},
        "min_tokens": {"type": "integer", "minimum": 0, "description": "vLLM's: no eos, stop token or stop string ends the answer before this many tokens (at most max_tokens)."},
        "stop_token_ids": {"type": "array", "items": {"type": "integer", "minimum": 0}, "description": "vLLM's: tokens that end the answer."},
        "skip_special_tokens": {"type": "boolean"}, "spaces_between_special_tokens": {"type": "boolean"},
        "include_stop_str_in_output": {"type": "boolean", "description": "vLLM's: keep the stop string or stop token's text."},
        "structured_outputs": {"type": "object", "description": "vLLM's: the answer follows one of json (a schema, or its JSON text), regex, choice, grammar (Lark, or GBNF with ::=) or json_object.", "properties": {
          "json": {"oneOf": [{"type": "object"}, {"type": "string"}]}, "regex": {"type": "string", "minLength": 1},
          "choice": {"type": "array", "minItems": 1, "items": {"type": "string"}}, "grammar": {"type": "string", "minLength": 1},
          "json_object": {"type": "boolean", "enum": [true]}, "disable_fallback": {"type": "boolean"}, "disable_any_whitespace": {"type": "boolean"},
          "disable_additional_properties": {"type": "boolean"}}},
        "guided_json": {"oneOf": [{"type": "object"}, {"type": "string"}], "description": "vLLM's older spelling of structured_outputs.json (likewise guided_regex, guided_choice, guided_grammar)."},
        "guided_regex": {"type": "string", "minLength": 1}, "guided_choice": {"type": "array", "minItems": 1, "items": {"type": "string"}},
        "guided_grammar": {"type": "string", "minLength": 1}, "guided_decoding_backend": {"type": "string", "description": "Accepted; one engine (llguidance) serves every backend name."},
        "grammar": {"type": "string", "minLength": 1, "description": "llama.cpp's server's: a GBNF (or Lark) grammar the answer follows."},
        "json_schema": {"type": "object", "description": "llama.cpp's server's: a JSON schema the answer follows ({} for any JSON)."}}},
      "CompletionRequest": {"allOf": [{"$ref": "#/components/schemas/Sampling"}, {"type": "object", "required": ["prompt"], "properties": {
        "model": {"type": "string"}, "prompt": {"description": "One prompt (text or token ids), or a batch: a list of texts or of token-id lists; prompt i's answer j is choice i * n + j.",
          "oneOf": [{"type": "string"}, {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}},
                    {"type": "array", "minItems": 1, "items": {"oneOf": [{"type": "string"}, {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}]}}]},
        "suffix": {"type": "string", "description": "Fill in the middle: the text after the gap, the prompt being the text before it (a model with FIM tokens; not with echo)."},
        "echo": {"type": "boolean"}, "logprobs": {"type": "integer", "minimum": 0, "maximum": 20}, "best_of": {"type": "integer", "minimum": 1, "maximum": 8},
        "response_format": {"type": "object", "required": ["type"], "description": "As chat's.", "properties": {"type": {"type": "string", "enum": ["text", "json_object", "json_schema"]},
          "json_schema": {"type": "object", "required": ["name", "schema"], "properties": {"name": {"type": "string"}, "schema": {"type": "object"}, "strict": {"type": "boolean"}, "description": {"type": "string"}}}}}}}]},
      "LlamaCppInfillRequest": {"allOf": [{"$ref": "#/components/schemas/LlamaCppCompletionRequest"}, {"type": "object", "required": ["input_prefix", "input_suffix"],
        "description": "llama.cpp's server's /infill: /completion's fields, with prompt (a string) the start of the answer after input_prefix.", "properties": {
        "input_prefix": {"type": "string", "description": "The text before the gap (its last 1,536 tokens are read)."},
        "input_suffix": {"type": "string", "description": "The text after the gap (its first 510 tokens, less the prompt's, are read)."},
        "input_extra": {"type": "array", "description": "Files of context, before the prefix.", "items": {"type": "object", "required": ["text"], "properties": {"filename": {"type": "string"}, "text": {"type": "string"}, "time": {"type": "number", "description": "llama.vim's; changes nothing."}}}}}}]},
      "LlamaCppCompletionRequest": {"type": "object", "required": ["prompt"], "description": "llama.cpp's server's /completion, with its names and defaults (temperature 0.8, top_k 40, top_p 0.95, min_p 0.05, its sampler order: the cuts before the temperature). Samplers this server lacks are accepted only off.", "properties": {
        "model": {"type": "string", "description": "Default: the served base model."},
        "prompt": {"description": "One prompt (text, token ids, or both mixed), or a list of prompts (texts, or lists of ids and texts), answered with a list.",
          "anyOf": [{"type": "string"}, {"type": "array", "minItems": 1, "items": {"oneOf": [{"type": "integer", "minimum": 0}, {"type": "string"}]}},
                    {"type": "array", "minItems": 1, "items": {"oneOf": [{"type": "string"}, {"type": "array", "minItems": 1, "items": {"oneOf": [{"type": "integer", "minimum": 0}, {"type": "string"}]}}]}}]},
        "n_predict": {"type": "integer", "minimum": -1, "description": "-1 (default): to the end of the context; 0 is refused."}, "max_tokens": {"type": "integer", "minimum": -1, "description": "n_predict's other name."},
        "temperature": {"type": "number", "maximum": 2, "description": "0 or below: greedy."}, "top_k": {"type": "integer", "description": "0 or below: off."},
        "top_p": {"type": "number", "minimum": 0, "maximum": 1}, "min_p": {"type": "number", "minimum": 0, "maximum": 1},
        "repeat_penalty": {"type": "number", "exclusiveMinimum": true, "minimum": 0, "maximum": 10}, "repeat_last_n": {"type": "integer", "minimum": -1, "description": "Tokens of prompt and answer the penalties count: -1 all, 0 none (default 64)."},
        "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2}, "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
        "stop": {"type": "array", "maxItems": 64, "items": {"type": "string", "minLength": 1}}, "seed": {"type": "integer", "maximum": 4294967295, "description": "-1: random (reported in generation_settings)."},
        "stream": {"type": "boolean"}, "n_probs": {"type": "integer", "minimum": 0, "maximum": 20}, "ignore_eos": {"type": "boolean"},
        "grammar": {"type": "string", "description": "GBNF (or Lark); empty: none."}, "json_schema": {"type": "object"},
        "logit_bias": {"oneOf": [{"type": "array", "items": {"type": "array", "minItems": 2, "maxItems": 2}}, {"type": "object"}], "description": "[[token id or text, bias or false]], or an object."},
        "samplers": {"type": "array", "items": {"type": "string", "enum": ["penalties", "top_k", "top_p", "min_p", "temperature", "dry", "typ_p", "typical_p", "xtc", "top_n_sigma", "infill", "mirostat"]}},
        "return_tokens": {"type": "boolean"}, "id_slot": {"type": "integer", "minimum": -1, "description": "-1 or a slot below /props' total_slots: changes nothing (the prefix cache reuses any prompt)."}, "cache_prompt": {"type": "boolean", "description": "Accepted: the prefix cache is always on."},
        "n_keep": {"type": "integer", "minimum": -1, "description": "Accepted: the context is never shifted."}, "n_discard": {"type": "integer", "minimum": 0},
        "n_cmpl": {"type": "integer", "enum": [1]}, "min_keep": {"type": "integer", "minimum": 0, "maximum": 1},
        "post_sampling_probs": {"type": "boolean", "enum": [false]}, "timings_per_token": {"type": "boolean", "enum": [false]}, "return_progress": {"type": "boolean", "enum": [false]}, "response_fields": {"type": "array", "items": {"type": "string"}, "description": "Only these fields in the answer (paths as timings/predicted_n, each under its path)."},
        "lora": {"type": "array", "maxItems": 0, "description": "Name an adapter in model instead."},
        "typical_p": {"type": "number", "minimum": 1}, "dynatemp_range": {"type": "number", "maximum": 0}, "dynatemp_exponent": {"type": "number"},
        "mirostat": {"type": "integer", "enum": [0]}, "mirostat_tau": {"type": "number"}, "mirostat_eta": {"type": "number"},
        "dry_multiplier": {"type": "number", "maximum": 0}, "dry_base": {"type": "number"}, "dry_allowed_length": {"type": "integer"}, "dry_penalty_last_n": {"type": "integer"},
        "dry_sequence_breakers": {"type": "array", "items": {"type": "string"}}, "xtc_probability": {"type": "number", "maximum": 0}, "xtc_threshold": {"type": "number"},
        "top_n_sigma": {"type": "number", "maximum": 0}, "t_max_predict_ms": {"type": "integer", "description": "Once the answer has a new line, it ends when it has been generating longer than this (ms; 0: no limit)."},
        "n_indent": {"type": "integer", "description": "A line after the answer's first starting with fewer spaces or tabs ends it there (0: off)."},
        "t_max_prompt_ms": {"type": "integer", "description": "Changes nothing (llama.cpp does not use it either)."}}},
      "EmbeddingsRequest": {"type": "object", "required": ["input"], "properties": {
        "model": {"type": "string"},
        "input": {"oneOf": [{"type": "string", "minLength": 1}, {"type": "array", "minItems": 1, "maxItems": 2048, "items": {"type": "string", "minLength": 1}},
          {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}},
          {"type": "array", "minItems": 1, "maxItems": 2048, "items": {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}}]},
        "encoding_format": {"type": "string", "enum": ["float", "base64"]},
        "dimensions": {"type": "integer", "minimum": 1, "description": "Only for a model with matryoshka_dimensions in its config.json."},
        "user": {"type": "string"}}},
      "OllamaOptions": {"type": "object", "description": "Ollama's options: the samplers as the OpenAI routes'; loading options (num_ctx, num_batch, num_gpu, num_thread, use_mmap, ...) change nothing and are listed in x-fsdp-app-ignored-params.", "properties": {
        "temperature": {"type": "number", "minimum": 0, "maximum": 2}, "top_k": {"type": "integer", "minimum": -1}, "top_p": {"type": "number", "exclusiveMinimum": true, "minimum": 0, "maximum": 1},
        "min_p": {"type": "number", "minimum": 0, "maximum": 1}, "seed": {"type": "integer"}, "num_predict": {"type": "integer", "minimum": -2, "description": "-1, -2: to the context's end; 0 is refused."},
        "stop": {"type": "array", "maxItems": 4, "items": {"type": "string", "minLength": 1}}, "repeat_penalty": {"type": "number", "exclusiveMinimum": true, "minimum": 0, "maximum": 10},
        "repeat_last_n": {"type": "integer", "minimum": -1}, "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2}, "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
        "num_ctx": {"type": "integer"}, "num_thread": {"type": "integer"}}},
      "OllamaChatRequest": {"type": "object", "required": ["model", "messages"], "description": "Ollama's /api/chat.", "properties": {
        "model": {"type": "string", "minLength": 1, "description": "A served model; name:latest is name."},
        "messages": {"type": "array", "items": {"type": "object", "required": ["role"], "properties": {
          "role": {"type": "string", "enum": ["system", "user", "assistant", "tool"]}, "content": {"type": "string"}, "thinking": {"type": "string"},
          "images": {"type": "array", "maxItems": 0}, "tool_name": {"type": "string"},
          "tool_calls": {"type": "array", "items": {"type": "object", "required": ["function"], "properties": {"function": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}, "arguments": {"type": "object"}}}}}}}}},
        "tools": {"type": "array", "items": {"type": "object"}}, "format": {"oneOf": [{"type": "string", "enum": ["", "json"]}, {"type": "object"}]},
        "options": {"$ref": "#/components/schemas/OllamaOptions"}, "stream": {"type": "boolean", "description": "Default true: newline-delimited JSON objects."},
        "keep_alive": {"oneOf": [{"type": "number"}, {"type": "string", "pattern": "^-?([0-9.]+(ns|us|µs|ms|s|m|h))+$"}]}, "think": {"oneOf": [{"type": "boolean"}, {"type": "string", "enum": ["low", "medium", "high"]}]}}},
      "OllamaGenerateRequest": {"type": "object", "required": ["model"], "description": "Ollama's /api/generate: prompt (and system) through the chat template, with raw as it is, or with suffix between the FIM tokens.", "properties": {
        "model": {"type": "string", "minLength": 1}, "prompt": {"type": "string"}, "system": {"type": "string"}, "raw": {"type": "boolean"},
        "suffix": {"type": "string", "description": "Fill in the middle: the text after the gap (a model with FIM tokens; not with raw or system)."}, "template": {"type": "string", "maxLength": 0}, "context": {"type": "array", "maxItems": 0}, "images": {"type": "array", "maxItems": 0},
        "format": {"oneOf": [{"type": "string", "enum": ["", "json"]}, {"type": "object"}]}, "options": {"$ref": "#/components/schemas/OllamaOptions"}, "stream": {"type": "boolean"},
        "keep_alive": {"oneOf": [{"type": "number"}, {"type": "string", "pattern": "^-?([0-9.]+(ns|us|µs|ms|s|m|h))+$"}]}, "think": {"type": "boolean"}}},
      "LlamaCppEmbeddingRequest": {"type": "object", "description": "llama.cpp's /embedding: content (or input) as /v1/embeddings' input, or ids and strings mixed in one list (one text).", "properties": {
        "content": {"oneOf": [{"type": "string", "minLength": 1}, {"type": "array", "minItems": 1}]},
        "input": {"oneOf": [{"type": "string", "minLength": 1}, {"type": "array", "minItems": 1}]},
        "embd_normalize": {"type": "integer", "minimum": -1, "description": "-1 none, 0 largest magnitude 32760, 1 taxicab, 2 Euclidean (default), p: p-norm."},
        "encoding_format": {"type": "string", "enum": ["float"]}, "model": {"type": "string"}}},
      "ScoreRequest": {"type": "object", "required": ["text_1", "text_2"], "description": "vLLM's: cosine similarity of embeddings; one text_1 against each text_2, or pairwise.", "properties": {
        "model": {"type": "string"}, "text_1": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
        "text_2": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]}, "user": {"type": "string"}}},
      "RerankRequest": {"type": "object", "required": ["query", "documents"], "description": "Jina's and Cohere's rerank (vLLM's): documents sorted by the cosine similarity of their embeddings to the query's.", "properties": {
        "model": {"type": "string"}, "query": {"type": "string"},
        "documents": {"type": "array", "minItems": 1, "items": {"oneOf": [{"type": "string"}, {"type": "object", "required": ["text"], "properties": {"text": {"type": "string"}}}]}},
        "top_n": {"type": "integer", "minimum": 0, "description": "0 or absent: all."}, "return_documents": {"type": "boolean"}, "user": {"type": "string"}}},
      "MessagesRequest": {"type": "object", "required": ["model", "messages", "max_tokens"], "description": "Anthropic's Messages API.", "allOf": [{"$ref": "#/components/schemas/CountTokensRequest"}, {"properties": {
        "max_tokens": {"type": "integer", "minimum": 1}, "stop_sequences": {"type": "array", "items": {"type": "string"}}, "stream": {"type": "boolean"},
        "temperature": {"type": "number", "minimum": 0, "maximum": 2}, "top_p": {"type": "number", "exclusiveMinimum": true, "minimum": 0, "maximum": 1},
        "top_k": {"type": "integer", "minimum": 1}, "metadata": {"type": "object", "properties": {"user_id": {"type": "string"}}},
        "service_tier": {"type": "string", "description": "Accepted; changes nothing here."}}}]},
      "CountTokensRequest": {"type": "object", "required": ["model", "messages"], "properties": {
        "model": {"type": "string"},
        "system": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "object", "required": ["type", "text"], "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}}}}]},
        "messages": {"type": "array", "minItems": 1, "items": {"type": "object", "required": ["role", "content"], "properties": {
          "role": {"type": "string", "enum": ["user", "assistant"]},
          "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "object", "required": ["type"], "properties": {
            "type": {"type": "string", "enum": ["text", "tool_use", "tool_result", "thinking", "redacted_thinking"]}, "text": {"type": "string"},
            "id": {"type": "string"}, "name": {"type": "string"}, "input": {"type": "object"}, "tool_use_id": {"type": "string"},
            "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]}, "is_error": {"type": "boolean"},
            "thinking": {"type": "string"}, "signature": {"type": "string"}}}}]}}}},
        "tools": {"type": "array", "items": {"type": "object", "required": ["name", "input_schema"], "properties": {"name": {"type": "string"},
          "description": {"type": "string"}, "input_schema": {"type": "object"}, "type": {"type": "string", "enum": ["custom"]}}}},
        "tool_choice": {"type": "object", "required": ["type"], "properties": {"type": {"type": "string", "enum": ["auto", "any", "tool", "none"]},
          "name": {"type": "string"}, "disable_parallel_tool_use": {"type": "boolean"}}},
        "thinking": {"type": "object", "required": ["type"], "properties": {"type": {"type": "string", "enum": ["enabled", "adaptive", "disabled"]},
          "budget_tokens": {"type": "integer", "minimum": 1}, "display": {"type": "string", "enum": ["summarized", "omitted"]}}},
        "output_config": {"type": "object", "properties": {"effort": {"type": "string", "enum": ["low", "medium", "high", "xhigh", "max"]},
          "format": {"type": "object", "required": ["type", "schema"], "properties": {"type": {"type": "string", "enum": ["json_schema"]}, "schema": {"type": "object"}}}}},
        "cache_control": {"type": "object", "description": "Accepted: the prefix cache keeps every prompt's blocks."}}},
      "ResponsesRequest": {"type": "object", "required": ["input"], "properties": {
        "model": {"type": "string"},
        "input": {"oneOf": [{"type": "string"}, {"type": "array", "minItems": 1, "items": {"type": "object", "properties": {
          "type": {"type": "string", "enum": ["message", "function_call", "function_call_output"]}, "role": {"type": "string", "enum": ["user", "assistant", "system", "developer"]},
          "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "object", "required": ["type", "text"], "properties": {"type": {"type": "string", "enum": ["input_text", "output_text"]}, "text": {"type": "string"}}}}]},
          "call_id": {"type": "string"}, "name": {"type": "string"}, "arguments": {"type": "string"}, "output": {"type": "string"}}}}]},
        "instructions": {"type": "string"},
        "tools": {"type": "array", "items": {"type": "object", "required": ["type", "name"], "properties": {"type": {"type": "string", "enum": ["function"]}, "name": {"type": "string"},
          "description": {"type": "string"}, "parameters": {"type": "object"}, "strict": {"type": "boolean"}}}},
        "tool_choice": {"oneOf": [{"type": "string", "enum": ["none", "auto", "required"]}, {"type": "object", "required": ["type", "name"], "properties": {"type": {"type": "string", "enum": ["function"]}, "name": {"type": "string"}}}]},
        "parallel_tool_calls": {"type": "boolean"},
        "text": {"type": "object", "properties": {"format": {"type": "object", "required": ["type"], "properties": {"type": {"type": "string", "enum": ["text", "json_object", "json_schema"]},
          "name": {"type": "string"}, "schema": {"type": "object"}, "strict": {"type": "boolean"}, "description": {"type": "string"}}}}},
        "max_output_tokens": {"type": "integer", "minimum": 1}, "temperature": {"type": "number", "minimum": 0, "maximum": 2},
        "top_p": {"type": "number", "exclusiveMinimum": true, "minimum": 0, "maximum": 1}, "stream": {"type": "boolean"},
        "seed": {"type": "integer", "description": "An extension (chat's seed): reproducible sampling."},
        "store": {"type": "boolean", "enum": [false]}, "previous_response_id": {"type": "string", "description": "Refused: responses are not stored."},
        "include": {"type": "array", "maxItems": 0}, "truncation": {"type": "string", "enum": ["disabled"]},
        "reasoning": {"type": "object", "properties": {"effort": {"type": "string", "enum": ["minimal", "low", "medium", "high"]}}},
        "metadata": {"type": "object", "additionalProperties": {"type": "string"}}, "user": {"type": "string"}, "service_tier": {"type": "string"},
        "prompt_cache_key": {"type": "string"}, "safety_identifier": {"type": "string"}}},
      "ChatRequest": {"allOf": [{"$ref": "#/components/schemas/Sampling"}, {"type": "object", "required": ["messages"], "properties": {
        "model": {"type": "string"}, "max_completion_tokens": {"type": "integer", "minimum": 1},
        "logprobs": {"type": "boolean"}, "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
        "tools": {"type": "array", "minItems": 1, "items": {"type": "object", "required": ["type", "function"], "properties": {"type": {"type": "string", "enum": ["function"]},
          "function": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}, "description": {"type": "string"}, "parameters": {"type": "object"}, "strict": {"type": "boolean"}}}}}},
        "tool_choice": {"oneOf": [{"type": "string", "enum": ["none", "auto", "required"]}, {"type": "object", "required": ["type", "function"], "properties": {"type": {"type": "string", "enum": ["function"]}, "function": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}}}]},
        "parallel_tool_calls": {"type": "boolean"},
        "store": {"type": "boolean", "enum": [false]}, "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
        "service_tier": {"type": "string"}, "prompt_cache_key": {"type": "string"}, "safety_identifier": {"type": "string"},
        "modalities": {"type": "array", "items": {"type": "string", "enum": ["text"]}},
        "reasoning_effort": {"type": "string", "enum": ["minimal", "low", "medium", "high"]},
        "chat_template_kwargs": {"type": "object", "description": "More variables for the chat template, e.g. {\"enable_thinking\": false} (vLLM's and SGLang's field)."},
        "continue_final_message": {"type": "boolean", "description": "vLLM's: the last message, the assistant's, is the start of the answer, which continues it."},
        "add_generation_prompt": {"type": "boolean", "description": "vLLM's: false with continue_final_message (true otherwise)."},
        "functions": {"type": "array", "minItems": 1, "items": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}, "description": {"type": "string"}, "parameters": {"type": "object"}}}},
        "function_call": {"oneOf": [{"type": "string", "enum": ["none", "auto"]}, {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}]},
        "response_format": {"type": "object", "required": ["type"], "properties": {"type": {"type": "string", "enum": ["text", "json_object", "json_schema"]},
          "json_schema": {"type": "object", "required": ["name", "schema"], "properties": {"name": {"type": "string"}, "schema": {"type": "object"}, "strict": {"type": "boolean"}, "description": {"type": "string"}}}}},
        "messages": {"type": "array", "minItems": 1, "items": {"type": "object", "required": ["role", "content"], "additionalProperties": false, "properties": {
          "role": {"type": "string", "enum": ["system", "developer", "user", "assistant", "tool"]}, "name": {"type": "string"},
          "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "object", "required": ["type", "text"], "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}}}}]},
          "tool_calls": {"type": "array", "items": {"type": "object", "required": ["function"], "properties": {"id": {"type": "string"}, "type": {"type": "string"}, "function": {"type": "object", "required": ["name", "arguments"], "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}}}}}},
          "tool_call_id": {"type": "string"}, "reasoning_content": {"type": "string"}, "reasoning": {"type": "string"}}}}}}]}
    }
  },
  "security": [{"bearer": []}],
  "paths": {
    "/health": {"get": {"security": [], "responses": {"200": {"description": "The server is up (also at /v1/health, as llama.cpp)."}}}},
    "/version": {"get": {"responses": {"200": {"description": "{\"version\": ...}: this server's version (vLLM's route)."}}}},
    "/metrics": {"get": {"responses": {"200": {"description": "Prometheus metrics.", "content": {"text/plain": {}}}}}},
    "/info": {"get": {"responses": {"200": {"description": "Limits and sampling defaults.", "content": {"application/json": {}}}}}},
    "/v1/models": {"get": {"responses": {"200": {"description": "The served model (also at /models, as llama.cpp).", "content": {"application/json": {}}}}}},
    "/v1/models/{id}": {"get": {"parameters": [{"name": "id", "in": "path", "required": true, "schema": {"type": "string"}}],
      "responses": {"200": {"description": "The model."}, "404": {"description": "No such model.", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}}},
      "delete": {"parameters": [{"name": "id", "in": "path", "required": true, "schema": {"type": "string"}}],
      "responses": {"200": {"description": "The fine-tuned model is deleted."}, "403": {"description": "The base model cannot be deleted."}, "404": {"description": "No such fine-tuned model."}}}},
    "/v1/completions": {"post": {"requestBody": {"required": true, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/CompletionRequest"}}}},
      "responses": {"200": {"description": "A text_completion object, or an SSE stream of them ending in [DONE]."},
        "400": {"description": "Invalid request.", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}},
        "404": {"description": "Unknown model."}, "429": {"description": "The queue is full (Retry-After)."}}}},
    "/v1/responses": {"post": {"requestBody": {"required": true, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ResponsesRequest"}}}},
      "responses": {"200": {"description": "A response object, or an SSE stream of typed response events."},
        "400": {"description": "Invalid request.", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}},
        "404": {"description": "Unknown model."}, "429": {"description": "The queue is full (Retry-After)."}}}},
    "/v1/embeddings": {"post": {"requestBody": {"required": true, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/EmbeddingsRequest"}}}},
      "responses": {"200": {"description": "A list of embedding objects with usage."},
        "400": {"description": "Invalid request.", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}},
        "404": {"description": "Unknown model."}, "429": {"description": "The queue is full (Retry-After)."}}}},
    "/v1/score": {"post": {"requestBody": {"required": true, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ScoreRequest"}}}},
      "responses": {"200": {"description": "A list of score objects with usage (also at /score)."}, "400": {"description": "Invalid request."}, "404": {"description": "Unknown model."}}}},
    "/v1/rerank": {"post": {"requestBody": {"required": true, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/RerankRequest"}}}},
      "responses": {"200": {"description": "results: index, relevance_score and document, best first (also at /rerank and /v2/rerank, and llama.cpp's /reranking and /v1/reranking)."}, "400": {"description": "Invalid request."}, "404": {"description": "Unknown model."}}}},
    "/v1/messages": {"post": {"requestBody": {"required": true, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/MessagesRequest"}}}},
      "responses": {"200": {"description": "A message object, or an SSE stream of Anthropic's message events."},
        "400": {"description": "Invalid request ({\"type\": \"error\", \"error\": {\"type\", \"message\"}})."},
        "404": {"description": "Unknown model."}, "429": {"description": "The queue is full (Retry-After)."}}}},
    "/v1/messages/count_tokens": {"post": {"requestBody": {"required": true, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/CountTokensRequest"}}}},
      "responses": {"200": {"description": "{\"input_tokens\": n}"}, "400": {"description": "Invalid request."}, "404": {"description": "Unknown model."}}}},
    "/v1/load_lora_adapter": {"post": {"requestBody": {"required": true, "content": {"application/json": {"schema": {"type": "object", "required": ["lora_name", "lora_path"],
        "properties": {"lora_name": {"type": "string"}, "lora_path": {"type": "string", "description": "A PEFT adapter directory under --lora-dir."}}}}}},
      "responses": {"200": {"description": "The adapter is served as model lora_name."}, "400": {"description": "Invalid name, path or adapter."},
        "403": {"description": "Run-time loading is off (no --lora-dir)."}}}},
    "/v1/unload_lora_adapter": {"post": {"requestBody": {"required": true, "content": {"application/json": {"schema": {"type": "object", "required": ["lora_name"],
        "properties": {"lora_name": {"type": "string"}, "lora_int_id": {"type": "integer"}}}}}},
      "responses": {"200": {"description": "The adapter is no longer served."}, "404": {"description": "No adapter of that name."}}}},
    "/completion": {"post": {"requestBody": {"required": true, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/LlamaCppCompletionRequest"}}}},
      "responses": {"200": {"description": "llama.cpp's answer object (content, tokens, stop_type, timings, ...), or an SSE stream of its events, the last with stop: true."},
        "400": {"description": "Invalid request.", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}, "429": {"description": "The queue is full (Retry-After)."}}}},
    "/infill": {"post": {"requestBody": {"required": true, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/LlamaCppInfillRequest"}}}},
      "responses": {"200": {"description": "As /completion: the text that fills the gap."}, "400": {"description": "Invalid request, or a model without fill-in-the-middle tokens (not_supported_error)."}}}},
    "/completions": {"post": {"requestBody": {"required": true, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/LlamaCppCompletionRequest"}}}},
      "responses": {"200": {"description": "As /completion (llama.cpp's other name of it)."}, "400": {"description": "Invalid request."}}}},
    "/embedding": {"post": {"requestBody": {"required": true, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/LlamaCppEmbeddingRequest"}}}},
      "responses": {"200": {"description": "llama.cpp's list of {index, embedding}, each embedding a list of one pooled vector, scaled as embd_normalize says."},
        "400": {"description": "Invalid request.", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}, "429": {"description": "The queue is full (Retry-After)."}}}},
    "/embeddings": {"post": {"requestBody": {"required": true, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/LlamaCppEmbeddingRequest"}}}},
      "responses": {"200": {"description": "As /embedding (llama.cpp's other name of it)."}, "400": {"description": "Invalid request."}}}},
    "/api/chat": {"post": {"requestBody": {"required": true, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/OllamaChatRequest"}}}},
      "responses": {"200": {"description": "Ollama's answer (message, done, done_reason, counts, durations), or newline-delimited objects, the last with done: true."},
        "400": {"description": "Invalid request ({\"error\"})."}, "404": {"description": "Unknown model."}, "429": {"description": "The queue is full (Retry-After)."}}}},
    "/api/generate": {"post": {"requestBody": {"required": true, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/OllamaGenerateRequest"}}}},
      "responses": {"200": {"description": "Ollama's answer (response, done, ...), or newline-delimited objects; an empty prompt answers done_reason load."},
        "400": {"description": "Invalid request ({\"error\"})."}, "404": {"description": "Unknown model."}, "429": {"description": "The queue is full (Retry-After)."}}}},
    "/api/embed": {"post": {"requestBody": {"required": true, "content": {"application/json": {"schema": {"type": "object", "required": ["model", "input"], "properties": {
        "model": {"type": "string"}, "input": {"oneOf": [{"type": "string", "minLength": 1}, {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}}]},
        "truncate": {"type": "boolean"}, "dimensions": {"type": "integer", "minimum": 1}, "options": {"type": "object"}, "keep_alive": {"type": "number"}}}}}},
      "responses": {"200": {"description": "{model, embeddings (unit length), prompt_eval_count, ...}"}, "400": {"description": "Invalid request."}, "404": {"description": "Unknown model."}}}},
    "/api/embeddings": {"post": {"requestBody": {"required": true, "content": {"application/json": {"schema": {"type": "object", "required": ["model", "prompt"], "properties": {
        "model": {"type": "string"}, "prompt": {"type": "string", "minLength": 1}, "options": {"type": "object"}, "keep_alive": {"type": "number"}}}}}},
      "responses": {"200": {"description": "{embedding}, not scaled."}, "400": {"description": "Invalid request."}, "404": {"description": "Unknown model."}}}},
    "/api/show": {"post": {"requestBody": {"required": true, "content": {"application/json": {"schema": {"type": "object", "properties": {
        "model": {"type": "string"}, "name": {"type": "string"}, "verbose": {"type": "boolean"}}}}}},
      "responses": {"200": {"description": "details, template, model_info, capabilities."}, "400": {"description": "No model named."}, "404": {"description": "Unknown model."}}}},
    "/api/tags": {"get": {"responses": {"200": {"description": "{models: [{name, model, modified_at, details}]}"}}}},
    "/api/ps": {"get": {"responses": {"200": {"description": "The loaded models (all served ones), with context_length."}}}},
    "/api/version": {"get": {"responses": {"200": {"description": "{version}: the version of Ollama's API the routes follow."}}}},
    "/props": {"get": {"responses": {"200": {"description": "llama.cpp's server properties: default_generation_settings (n_ctx, params), total_slots, chat_template."}}}},
    "/apply-template": {"post": {"requestBody": {"required": true, "content": {"application/json": {"schema": {"type": "object", "required": ["messages"], "properties": {
        "model": {"type": "string"}, "messages": {"type": "array", "minItems": 1, "items": {"type": "object"}},
        "tools": {"type": "array", "items": {"type": "object"}}, "chat_template_kwargs": {"type": "object"}}}}}},
      "responses": {"200": {"description": "{\"prompt\"}: the conversation as the chat template renders it, the assistant's turn opened."}, "400": {"description": "Invalid request."}}}},
    "/v1/chat/completions": {"post": {"requestBody": {"required": true, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ChatRequest"}}}},
      "responses": {"200": {"description": "A chat.completion object, or an SSE stream of chat.completion.chunk ending in [DONE] (also at /chat/completions, as llama.cpp)."},
        "400": {"description": "Invalid request.", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}},
        "404": {"description": "Unknown model."}, "429": {"description": "The queue is full (Retry-After)."}}}},
    "/tokenize": {"post": {"requestBody": {"required": true, "content": {"application/json": {"schema": {"type": "object", "properties": {
        "model": {"type": "string"}, "prompt": {"type": "string"}, "add_special_tokens": {"type": "boolean"},
        "messages": {"type": "array", "items": {"type": "object"}}, "chat_template_kwargs": {"type": "object"},
        "tools": {"type": "array", "items": {"type": "object"}},
        "content": {"type": "string", "description": "llama.cpp's: the text, answered in llama.cpp's shape ({\"tokens\"}); with it only add_special, parse_special (true), with_pieces and model."},
        "add_special": {"type": "boolean"}, "parse_special": {"type": "boolean", "enum": [true]}, "with_pieces": {"type": "boolean"}}}}}},
      "responses": {"200": {"description": "Token ids."}, "400": {"description": "Invalid request."}, "404": {"description": "Unknown model."}}}},
    "/tokenizer_info": {"get": {"responses": {"200": {"description": "vLLM's: the base model's tokenizer settings (tokenizer_config.json's fields as transformers gives them: special tokens as text, tokenizer_class, chat_template)."}}}},
    "/detokenize": {"post": {"requestBody": {"required": true, "content": {"application/json": {"schema": {"type": "object", "required": ["tokens"], "properties": {
        "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0}}}}}}},
      "responses": {"200": {"description": "Text."}, "400": {"description": "Invalid request."}}}},
    "/v1/files": {
      "get": {"responses": {"200": {"description": "Uploaded files."}}},
      "post": {"requestBody": {"required": true, "content": {"multipart/form-data": {"schema": {"type": "object", "required": ["purpose", "file"], "properties": {
        "purpose": {"type": "string", "enum": ["fine-tune"]}, "file": {"type": "string", "format": "binary"}}}}}},
        "responses": {"200": {"description": "The file object."}, "400": {"description": "Invalid file (the line is named)."}}}},
    "/v1/files/{id}": {
      "get": {"parameters": [{"name": "id", "in": "path", "required": true, "schema": {"type": "string"}}], "responses": {"200": {"description": "The file."}, "404": {"description": "No such file."}}},
      "delete": {"parameters": [{"name": "id", "in": "path", "required": true, "schema": {"type": "string"}}], "responses": {"200": {"description": "Deleted."}, "404": {"description": "No such file."}}}},
    "/v1/files/{id}/content": {"get": {"parameters": [{"name": "id", "in": "path", "required": true, "schema": {"type": "string"}}],
      "responses": {"200": {"description": "The JSONL contents."}, "404": {"description": "No such file."}}}},
    "/v1/fine_tuning/jobs": {
      "get": {"parameters": [{"name": "after", "in": "query", "schema": {"type": "string"}}, {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 100}}],
        "responses": {"200": {"description": "Jobs, newest first, with has_more."}, "400": {"description": "Invalid paging."}}},
      "post": {"parameters": [{"name": "Idempotency-Key", "in": "header", "schema": {"type": "string"}}],
        "requestBody": {"required": true, "content": {"application/json": {"schema": {"type": "object", "required": ["model", "training_file"], "properties": {
          "model": {"type": "string"}, "training_file": {"type": "string"}, "validation_file": {"type": "string"}, "suffix": {"type": "string", "maxLength": 64},
          "seed": {"type": "integer", "minimum": 0},
          "method": {"type": "object", "required": ["type"], "properties": {"type": {"type": "string", "enum": ["supervised", "dpo", "reinforcement"]}, "supervised": {"type": "object", "properties": {"hyperparameters": {"type": "object"}}}, "dpo": {"type": "object", "properties": {"hyperparameters": {"type": "object"}}},
            "reinforcement": {"type": "object", "required": ["grader"], "properties": {"grader": {"type": "object", "description": "string_check, text_similarity, json_schema, multi or command (docs/grpo.md)."},
              "hyperparameters": {"type": "object", "description": "n_epochs, batch_size (prompts per step), learning_rate_multiplier, compute_multiplier (completions per prompt: 8 x it), eval_interval and eval_samples (\"auto\" only)."}}}}},
          "hyperparameters": {"type": "object", "properties": {
            "n_epochs": {"oneOf": [{"type": "integer", "minimum": 1, "maximum": 50}, {"type": "string", "enum": ["auto"]}]},
            "batch_size": {"oneOf": [{"type": "integer", "minimum": 1, "maximum": 256}, {"type": "string", "enum": ["auto"]}]},
            "learning_rate_multiplier": {"oneOf": [{"type": "number", "minimum": 0.001, "maximum": 100}, {"type": "string", "enum": ["auto"]}]}}},
          "fsdp_app": {"type": "object", "properties": {"world_size": {"type": "integer", "minimum": 1, "maximum": 16}, "seq_len": {"type": "integer", "minimum": 16},
            "max_steps": {"type": "integer", "minimum": 1}, "max_completion_length": {"type": "integer", "minimum": 1, "description": "Reinforcement jobs: the most tokens a completion may have (default: half of seq_len)."}, "lora": {"type": "object", "properties": {"r": {"type": "integer", "minimum": 1}, "alpha": {"type": "number"},
            "dropout": {"type": "number", "minimum": 0, "maximum": 0.99}, "targets": {"type": "array", "items": {"type": "string"}}}},
            "merge": {"type": "boolean", "description": "With lora: serve a merged copy instead of the adapter over the base."}}}}}}}},
        "responses": {"200": {"description": "The job (the same one again for a retried Idempotency-Key)."}, "400": {"description": "Invalid request."},
          "409": {"description": "The Idempotency-Key was used for a job with other settings."}}}},
    "/v1/fine_tuning/jobs/{id}": {"get": {"parameters": [{"name": "id", "in": "path", "required": true, "schema": {"type": "string"}}],
      "responses": {"200": {"description": "The job."}, "404": {"description": "No such job."}}}},
    "/v1/fine_tuning/jobs/{id}/cancel": {"post": {"parameters": [{"name": "id", "in": "path", "required": true, "schema": {"type": "string"}}],
      "responses": {"200": {"description": "The cancelled job."}, "400": {"description": "Already finished."}, "404": {"description": "No such job."}}}},
    "/v1/fine_tuning/jobs/{id}/events": {"get": {"parameters": [{"name": "id", "in": "path", "required": true, "schema": {"type": "string"}},
        {"name": "after", "in": "query", "schema": {"type": "string"}}, {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 100}}],
      "responses": {"200": {"description": "Events, newest first."}, "404": {"description": "No such job."}}}},
    "/v1/fine_tuning/jobs/{id}/checkpoints": {"get": {"parameters": [{"name": "id", "in": "path", "required": true, "schema": {"type": "string"}}],
      "responses": {"200": {"description": "Checkpoints."}, "404": {"description": "No such job."}}}}
  }
}"##;

#[cfg(test)]
mod tests {
    #[test]
    fn the_spec_is_json_and_lists_every_route() {
        let v: serde_json::Value = serde_json::from_str(super::SPEC).unwrap();
        for p in [
            "/health",
            "/metrics",
            "/info",
            "/v1/models",
            "/v1/completions",
            "/v1/chat/completions",
            "/tokenize",
            "/detokenize",
            "/tokenizer_info",
            "/completion",
            "/infill",
            "/props",
            "/api/chat",
            "/api/generate",
            "/api/embed",
            "/api/tags",
            "/embedding",
            "/v1/files",
            "/v1/fine_tuning/jobs",
        ] {
            assert!(v["paths"].get(p).is_some(), "{p}");
        }
    }

    /// The fields the spec lists are the fields the server accepts (`fields`), no more, no less.
    #[test]
    fn the_spec_lists_the_accepted_fields() {
        use std::collections::BTreeSet;
        let v: serde_json::Value = serde_json::from_str(super::SPEC).unwrap();
        let props = |schema: &serde_json::Value| -> BTreeSet<String> {
            let mut out = BTreeSet::new();
            for part in schema.get("allOf").and_then(|a| a.as_array()).cloned().unwrap_or_else(|| vec![schema.clone()]) {
                let part = match part.get("$ref").and_then(|r| r.as_str()) {
                    Some(r) => v["components"]["schemas"][r.rsplit('/').next().unwrap()].clone(),
                    None => part,
                };
                out.extend(part["properties"].as_object().unwrap().keys().cloned());
            }
            out
        };
        let set = |f: &[&str]| f.iter().map(|s| s.to_string()).collect::<BTreeSet<_>>();
        let vllm = set(crate::serve::fields::VLLM_SAMPLING)
            .union(&set(crate::serve::validate::structured::FIELDS))
            .cloned()
            .collect::<BTreeSet<_>>();
        let with_vllm = |f: &[&str]| set(f).union(&vllm).cloned().collect::<BTreeSet<_>>();
        let schemas = &v["components"]["schemas"];
        assert_eq!(props(&schemas["CompletionRequest"]), with_vllm(crate::serve::fields::COMPLETIONS));
        let tokenize = &v["paths"]["/tokenize"]["post"]["requestBody"]["content"]["application/json"]["schema"];
        let llama_tokenize = set(crate::serve::llama_cpp::TOKENIZE);
        assert_eq!(props(tokenize), set(crate::serve::fields::TOKENIZE).union(&llama_tokenize).cloned().collect());
        assert_eq!(props(&schemas["LlamaCppCompletionRequest"]), set(crate::serve::validate::llama_cpp::FIELDS));
        let infill =
            set(crate::serve::validate::llama_cpp::FIELDS).union(&set(crate::serve::validate::infill::INFILL_FIELDS)).cloned().collect();
        assert_eq!(props(&schemas["LlamaCppInfillRequest"]), infill);
        let apply = &v["paths"]["/apply-template"]["post"]["requestBody"]["content"]["application/json"]["schema"];
        assert_eq!(props(apply), set(crate::serve::llama_cpp::APPLY_TEMPLATE));
        assert_eq!(props(&schemas["ChatRequest"]), with_vllm(crate::serve::fields::CHAT));
        assert_eq!(props(&schemas["ResponsesRequest"]), set(crate::serve::fields::RESPONSES));
        assert_eq!(props(&schemas["EmbeddingsRequest"]), set(crate::serve::embeddings::FIELDS));
        assert_eq!(props(&schemas["LlamaCppEmbeddingRequest"]), set(crate::serve::llama_cpp::EMBEDDING));
        assert_eq!(props(&schemas["ScoreRequest"]), set(crate::serve::scores::SCORE_FIELDS));
        assert_eq!(props(&schemas["RerankRequest"]), set(crate::serve::scores::RERANK_FIELDS));
        use crate::serve::validate::anthropic;
        assert_eq!(props(&schemas["MessagesRequest"]), set(anthropic::accepted(false)));
        assert_eq!(props(&schemas["CountTokensRequest"]), set(anthropic::accepted(true)));
        use crate::serve::validate::ollama;
        assert_eq!(props(&schemas["OllamaChatRequest"]), set(ollama::CHAT));
        assert_eq!(props(&schemas["OllamaGenerateRequest"]), set(ollama::GENERATE));
        assert_eq!(props(&schemas["OllamaChatRequest"]["properties"]["messages"]["items"]), set(ollama::MESSAGE));
        assert_eq!(props(&schemas["ChatRequest"]["allOf"][1]["properties"]["messages"]["items"]), set(crate::serve::fields::MESSAGE));
        let job = &v["paths"]["/v1/fine_tuning/jobs"]["post"]["requestBody"]["content"]["application/json"]["schema"];
        assert_eq!(props(job), set(crate::serve::fields::JOB));
        assert_eq!(props(&job["properties"]["fsdp_app"]), set(crate::serve::fields::JOB_EXTENSION));
    }
}
