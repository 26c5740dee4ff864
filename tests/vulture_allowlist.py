"""Names vulture may not call dead in builder/, runtime/, triton_repo/, bench/ and deploy/ (tests/test_dead_code.py),
each with why: a framework or a library reads it by name (click, FastAPI, pydantic, jinja2, Triton, ONNX Runtime, ONNX,
transformers), it is public API the docs name, or it is pending another change.

vulture reads this file as more source: ``_.name`` marks every definition called ``name`` as used. Nothing runs it.
Keep one name a line, with its reason after ``#`` (the test checks both, and that the name is still defined);
dead code is removed, not added here.
"""


class _Names:
    def __getattr__(self, name: str) -> "_Names":
        return self


_ = _Names()

# --- click commands: registered by their decorators, found by name in runtime/cli.py's COMMANDS -----------------------
_.openai_load  # click command `draftsmith openai-load` (bench/openai_load.py)
_.profile  # click command `draftsmith profile` (bench/profile.py)
_.bench  # click command `draftsmith bench` (bench/speed.py)
_.tree_headroom  # click command `draftsmith tree-headroom` (bench/tree.py)
_.inspect_cmd  # click command `build-engines inspect` (builder/cli.py)
_.distill  # click command `draftsmith distill` (builder/distill/cli.py); also a pydantic field of runtime/presets.py
_.serve_openai  # click command `draftsmith serve-openai` (runtime/cli.py)
_.kubernetes  # click command `draftsmith deploy kubernetes` (deploy/)

# --- FastAPI: routes and exception handlers registered by their decorators (runtime/serving/openai_server.py) ---------
_.completions  # FastAPI route POST /v1/completions
_.chat_completions  # FastAPI route POST /v1/chat/completions
_.api_error  # FastAPI exception handler (APIError)
_.http_error  # FastAPI exception handler (404/405)
_.internal  # FastAPI exception handler (any other exception: a 500)

# --- pydantic: validators and serializers registered by their decorators ----------------------------------------------
_._drafter_is_registered  # pydantic field_validator (runtime/core/request.py)
_._seeds_are_not_negative  # pydantic field_validator (runtime/core/request.py)
_._tiny_temperatures_are_greedy  # pydantic field_validator (runtime/core/request.py)
_._stops_are_not_empty  # pydantic field_validator (runtime/core/request.py)
_._one_choice  # pydantic field_validator (runtime/serving/openai_protocol.py)
_._stop_list  # pydantic field_validator (runtime/serving/openai_protocol.py)
_._unsupported  # pydantic field_validator (runtime/serving/openai_protocol.py)
_._only_streamed  # pydantic field_validator (runtime/serving/openai_protocol.py)
_._one_prompt  # pydantic field_validator (runtime/serving/openai_protocol.py)
_._bounded_metadata  # pydantic field_validator (runtime/serving/openai_protocol.py)
_._tools_and_logprobs  # pydantic model_validator (runtime/serving/openai_protocol.py)
_._present  # pydantic model_serializer (runtime/serving/openai_responses.py)

# --- pydantic fields: part of a schema (validated on the way in, serialized on the way out), never read by name -------
_.schema_version  # pydantic field: manifest.json's and a preset's version (runtime/bundle.py, runtime/presets.py)
_.user  # pydantic field: OpenAI request field accepted and ignored (runtime/serving/openai_protocol.py)
_.frequency_penalty  # pydantic field: OpenAI request field, neutral value only (openai_protocol.py)
_.presence_penalty  # pydantic field: OpenAI request field, neutral value only (openai_protocol.py)
_.logit_bias  # pydantic field: OpenAI request field, neutral value only (openai_protocol.py)
_.best_of  # pydantic field: OpenAI completions request field (openai_protocol.py)
_.strict  # pydantic field: OpenAI function tool's `strict` (openai_protocol.py)
_.function_call  # pydantic field: OpenAI chat request field (openai_protocol.py)
_.modalities  # pydantic field: OpenAI chat request field (openai_protocol.py)
_.audio  # pydantic field: OpenAI chat request field (openai_protocol.py)
_.prediction  # pydantic field: OpenAI chat request field (openai_protocol.py)
_.reasoning_effort  # pydantic field: OpenAI chat request field (openai_protocol.py)
_.web_search_options  # pydantic field: OpenAI chat request field (openai_protocol.py)
_.service_tier  # pydantic field: OpenAI chat request field (openai_protocol.py)
_.parallel_tool_calls  # pydantic field: OpenAI chat request field (openai_protocol.py)
_.prompt_cache_key  # pydantic field: OpenAI chat request field (openai_protocol.py)
_.safety_identifier  # pydantic field: OpenAI chat request field (openai_protocol.py)
_.total_tokens  # pydantic field: OpenAI response `usage` (runtime/serving/openai_responses.py)
_.created  # pydantic field: OpenAI response `created` (openai_responses.py)
_.text_offset  # pydantic field: OpenAI completions logprobs (openai_responses.py)
_.system_fingerprint  # pydantic field: OpenAI response `system_fingerprint` (openai_responses.py)

# --- jinja2: the sandbox's hooks, called by jinja2 by name (runtime/text/chat_template.py) ----------------------------
_.intercepted_binops  # jinja2 SandboxedEnvironment attribute: the binops it routes to call_binop
_.code_generator_class  # jinja2 Environment attribute: the compiler class
_.concat_values  # called by the code ConcatGenerator compiles `~` to
_.concat  # jinja2 Environment.concat: block, macro and filter output
_.visit_Concat  # jinja2 CodeGenerator visitor, dispatched by node class name
_.__self  # jinja2 SandboxedEnvironment.call's own parameter name (a keyword `self` must not clash)

# --- Triton's Python backend: the model class and methods it calls by name (triton_repo/models/*.py) ------------------
_.TritonPythonModel  # Triton Python backend model class
_.initialize  # Triton Python backend API
_.execute  # Triton Python backend API
_.finalize  # Triton Python backend API

# --- attributes set on library objects, read by that library ----------------------------------------------------------
_.execution_mode  # onnxruntime.SessionOptions (runtime/engines/sessions.py)
_.graph_optimization_level  # onnxruntime.SessionOptions
_.inter_op_num_threads  # onnxruntime.SessionOptions
_.intra_op_num_threads  # onnxruntime.SessionOptions
_.use_per_session_threads  # onnxruntime.SessionOptions
_.enable_profiling  # onnxruntime.SessionOptions (bench/profile.py)
_.profile_file_prefix  # onnxruntime.SessionOptions (bench/profile.py)
_.ir_version  # onnx ModelProto field, written into the saved graph (builder/graph.py, attention_classes.py)
_.doc_string  # onnx proto field, written into the saved graph (builder/export.py)
_.pre_tokenizer  # tokenizers.Tokenizer property (bench/guards.py)
_.hf_quantizer  # transformers PreTrainedModel attribute, cleared so save_pretrained writes plain weights
_.do_sample  # openvino_genai.GenerationConfig field (bench/peers/openvino_peer.py)
_.stop_token_ids  # openvino_genai.GenerationConfig field
_.max_ngram_size  # openvino_genai.GenerationConfig field (prompt lookup)
_.num_assistant_tokens  # openvino_genai / transformers GenerationConfig field (bench/peers/)
_.num_assistant_tokens_schedule  # transformers GenerationConfig field (bench/peers/transformers_peer.py)
_.ignore_aliases  # yaml.SafeDumper hook, called by PyYAML (deploy/)

# --- read by reflection inside the packages ---------------------------------------------------------------------------
_.fallback_steps  # RequestStats counter read by name: metric_families.py _total("fallback_steps"), metrics.py
_.system_efficiency  # RequestStats property read by name: metric_families.py _total("system_efficiency")
_.draft_gpu_device_ids  # EngineLayout field read as getattr(layout, f"{role}_gpu_device_ids") (trtllm/layouts.py)
_.draft_participant_ids  # EngineLayout field read as getattr(layout, f"{role}_participant_ids")
_.duration_s  # LoadResult field, in the load report through asdict() (bench/load.py summary)
_._measure_here  # run in a child process by name: `from deploy.sizing import _measure_here` (deploy/sizing.py)

# --- public API the docs name -----------------------------------------------------------------------------------------
_.metrics_text  # SpeculativeGenerator.metrics_text(): README.md, docs/running.md, docs/operations.md
_.open_generator  # runtime.trtllm.engine.open_generator: docs/tensorrt_llm.md, docs/building.md; gpu_check_tasks.py
_.bls_request  # the BLS request body: docs/tensorrt_llm.md; sent by scripts/gpu_check_tasks.py
_.llmapi_request  # the LLM API request body: sent by scripts/gpu_check_tasks.py (beside bls_request)

# --- data tests read: results and counters a caller inspects (no behaviour depends on them) ---------------------------
_.session_width  # engines' Call record field for CallObservers; tests/test_request_isolation.py checks padding with it
_.origin  # LoadResult field: the clock the records' started/ended count from (tests/test_triton_server_faults.py)
_.ended  # load Record field, with `origin` (tests/test_triton_server_faults.py aligns a restart with it)
_.mask_count  # grammar row counter: masks computed (tests/test_grammar_bounds.py checks a mask is computed once)
_.looked_up  # HybridDrafter counter: rows the free drafter proposed (tests/test_lookup.py, tests/test_suffix.py)
_.tiny_config  # Architecture field: the tiny test model's extra config keys, kept beside the entry they test (conftest)
_.sent_to_worker  # BodyParser counter: bodies parsed by its worker process (tests/test_body_parser.py checks the path)
_.body_parser  # app.state attribute: the app's BodyParser (tests/test_body_parser.py reads it and stops its worker)
