//! The backbone's OpenAI-compatible API over a real swarm (backbone, hub, TLS gateway and a
//! worker holding every expert, each its own process): completions and chats, streamed and
//! not, concurrent users sharing decode steps with each answer the bits of a local run, stop
//! strings, a full queue, callers who hang up, and bad requests answered in that API's error
//! shape.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use kvasir_api::generation::GenerationReport;
use kvasir_api::openai::{ChatChunk, ChatCompletion, Completion, ErrorResponse, ModelList};
use kvasir_tests::swarm::{http, https, HttpsCall, Swarm};

const PROMPT: &str = "The capital of France is";

/// The tiny preset's end token, as its text.
const EOS_TEXT: &str = "<|endoftext|>";

fn post(addr: &str, path: &str, body: &serde_json::Value) -> (u16, String) {
    http(addr, "POST", path, &body.to_string())
}

/// What the completion of `prompt` must say: the local run's text up to its end token, and
/// its finish reason.
fn expected(local: &GenerationReport) -> (String, &'static str) {
    match local.text.split_once(EOS_TEXT) {
        Some((before, _)) => (before.to_string(), "stop"),
        None => (local.text.clone(), "length"),
    }
}

/// The `data:` payloads of a server-sent event stream, in order (HTTP chunk sizes skipped).
fn events(raw: &str) -> Vec<String> {
    raw.lines()
        .filter_map(|l| l.strip_prefix("data: ").or_else(|| l.strip_prefix("data:")))
        .map(|d| d.trim().to_string())
        .collect()
}

/// Completes every prompt greedily at once, one client each, and checks each answer is the
/// local run's text and finish reason.
fn all_get_their_local_answers(swarm: &Swarm, addr: &str, prompts: &[&str], max_tokens: usize) {
    let answers: Vec<(u16, String)> = std::thread::scope(|scope| {
        let handles: Vec<_> = prompts
            .iter()
            .map(|prompt| {
                scope.spawn(move || {
                    let ask = serde_json::json!({"prompt": prompt, "max_tokens": max_tokens,
                        "temperature": 0});
                    post(addr, "/v1/completions", &ask)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (prompt, (status, body)) in prompts.iter().zip(&answers) {
        assert_eq!(*status, 200, "{body}");
        let completion: Completion = serde_json::from_str(body).unwrap();
        let (text, reason) = expected(&swarm.local(prompt, max_tokens));
        assert_eq!(completion.choices[0].text, text, "{prompt}");
        assert_eq!(completion.choices[0].finish_reason.as_deref(), Some(reason));
    }
}

#[test]
fn openai_completions_and_chats_over_the_swarm_equal_local_runs() {
    let mut swarm = Swarm::start("tiny");
    swarm.add_worker("*:*");
    let (_backbone, addr) = swarm.serve_backbone("*:*");

    let (status, body) = http(&addr, "GET", "/v1/models", "");
    assert_eq!(status, 200, "{body}");
    let models: ModelList = serde_json::from_str(&body).unwrap();
    let model = models.data[0].id.clone();

    // A completion: the local run's text and token counts.
    let local = swarm.local(PROMPT, 8);
    let (text, reason) = expected(&local);
    let ask =
        serde_json::json!({"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0});
    let (status, body) = post(&addr, "/v1/completions", &ask);
    assert_eq!(status, 200, "{body}");
    let completion: Completion = serde_json::from_str(&body).unwrap();
    assert_eq!(completion.object, "text_completion");
    assert_eq!(completion.choices[0].text, text);
    assert_eq!(completion.choices[0].finish_reason.as_deref(), Some(reason));
    let usage = completion.usage.unwrap();
    assert_eq!(usage.prompt_tokens, local.prompt_ids.len());
    assert_eq!(usage.completion_tokens, local.token_ids.len());

    // The same streamed: the pieces add up to the same text, then [DONE].
    let mut streamed = ask.clone();
    streamed["stream"] = true.into();
    streamed["stream_options"] = serde_json::json!({"include_usage": true});
    let (status, raw) = post(&addr, "/v1/completions", &streamed);
    assert_eq!(status, 200, "{raw}");
    let data = events(&raw);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{raw}");
    let chunks: Vec<Completion> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let joined: String = chunks.iter().map(|c| c.choices[0].text.as_str()).collect();
    assert_eq!(joined, text);
    let last = chunks.last().unwrap();
    assert_eq!(last.choices[0].finish_reason.as_deref(), Some(reason));
    assert_eq!(
        last.usage.as_ref().unwrap().completion_tokens,
        usage.completion_tokens
    );

    // A chat is the completion of its ChatML prompt.
    let chatml = "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n";
    let as_completion = serde_json::json!({"prompt": chatml, "max_tokens": 6, "temperature": 0});
    let (_, body) = post(&addr, "/v1/completions", &as_completion);
    let reference: Completion = serde_json::from_str(&body).unwrap();
    let chat = serde_json::json!({"model": model, "max_tokens": 6, "temperature": 0,
        "messages": [{"role": "user", "content": "Hello there"}]});
    let (status, body) = post(&addr, "/v1/chat/completions", &chat);
    assert_eq!(status, 200, "{body}");
    let answer: ChatCompletion = serde_json::from_str(&body).unwrap();
    assert_eq!(answer.object, "chat.completion");
    assert_eq!(answer.choices[0].message.role, "assistant");
    assert_eq!(answer.choices[0].message.content, reference.choices[0].text);
    // Streamed: the role first, then the same content.
    let mut chat_stream = chat.clone();
    chat_stream["stream"] = true.into();
    let (status, raw) = post(&addr, "/v1/chat/completions", &chat_stream);
    assert_eq!(status, 200, "{raw}");
    let data = events(&raw);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<ChatChunk> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    assert_eq!(
        chunks[0].choices[0].delta.role.as_deref(),
        Some("assistant")
    );
    let content: String = chunks
        .iter()
        .filter_map(|c| c.choices[0].delta.content.as_deref())
        .collect();
    assert_eq!(content, reference.choices[0].text);
    assert!(chunks.last().unwrap().choices[0].finish_reason.is_some());

    // A stop string cuts the text before it.
    let long = swarm.local(PROMPT, 24);
    let (long_text, _) = expected(&long);
    let words: Vec<&str> = long_text.split_inclusive(' ').collect();
    if words.len() > 2 {
        let stop = words[1].trim();
        if !stop.is_empty() {
            let before = &long_text[..long_text.find(stop).unwrap()];
            // Long enough that the stop comes well before the batch's end.
            let ask = serde_json::json!({"prompt": PROMPT, "max_tokens": 400, "temperature": 0, "stop": [stop]});
            let (status, body) = post(&addr, "/v1/completions", &ask);
            assert_eq!(status, 200, "{body}");
            let stopped: Completion = serde_json::from_str(&body).unwrap();
            assert_eq!(stopped.choices[0].text, before, "stop {stop:?}");
            assert_eq!(stopped.choices[0].finish_reason.as_deref(), Some("stop"));
            // It ends as completed, not as a caller who hung up.
            until(&addr, "kvasir_backbone_running_sequences", 0);
            let hung_up = metric(&addr, "kvasir_backbone_generations_hung_up_total");
            assert_eq!(hung_up, 0);
        }
    }

    // The public gateway relays the API (TLS), streams included, with the same answers.
    let gateway = swarm.gateway_addr.clone();
    let (status, body) = https(&gateway, &swarm.cert(), "GET", "/v1/models", "");
    assert_eq!(status, 404, "no --backbone yet: {body}");
    assert!(
        serde_json::from_str::<ErrorResponse>(&body).is_ok(),
        "{body}"
    );
    swarm.restart_gateway_with(&["--backbone", &format!("http://{addr}")]);
    let (status, body) = https(&gateway, &swarm.cert(), "GET", "/v1/models", "");
    assert_eq!(status, 200, "{body}");
    assert_eq!(serde_json::from_str::<ModelList>(&body).unwrap(), models);
    let (status, body) = https(
        &gateway,
        &swarm.cert(),
        "POST",
        "/v1/completions",
        &ask.to_string(),
    );
    assert_eq!(status, 200, "{body}");
    let relayed: Completion = serde_json::from_str(&body).unwrap();
    assert_eq!(relayed.choices, completion.choices);
    let (status, raw) = https(
        &gateway,
        &swarm.cert(),
        "POST",
        "/v1/completions",
        &streamed.to_string(),
    );
    assert_eq!(status, 200, "{raw}");
    let data = events(&raw);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{raw}");
    let joined: String = data[..data.len() - 1]
        .iter()
        .map(|d| {
            serde_json::from_str::<Completion>(d).unwrap().choices[0]
                .text
                .clone()
        })
        .collect();
    assert_eq!(joined, text);
    let (status, body) = https(
        &gateway,
        &swarm.cert(),
        "POST",
        "/v1/completions",
        r#"{"prompt": "x", "n": 3}"#,
    );
    assert_eq!(status, 400);
    assert!(
        serde_json::from_str::<ErrorResponse>(&body).is_ok(),
        "{body}"
    );
}

/// Users at once share decode steps, and each gets the bits it would get alone.
#[test]
fn concurrent_users_each_get_their_local_answer() {
    let mut swarm = Swarm::start("tiny");
    swarm.add_worker("*:*");
    let (_backbone, addr) = swarm.serve_backbone("*:*");
    let prompts = [
        "The capital of France is",
        "Once upon a time",
        "Bytes are slack; round trips",
        "A worker anywhere",
        "The ledger says",
        "Hello",
    ];
    all_get_their_local_answers(&swarm, &addr, &prompts, 12);
    // The old endpoint goes through the same batch, and still gives the local bits.
    let request = serde_json::json!({"prompt": PROMPT, "tokens": 8});
    let (status, body) = post(&addr, "/generate", &request);
    assert_eq!(status, 200, "{body}");
    let report: GenerationReport = serde_json::from_str(&body).unwrap();
    let local = swarm.local(PROMPT, 8);
    assert_eq!(report.token_ids, local.token_ids);
    assert_eq!(report.logits_blake3, local.logits_blake3);
}

/// With room for one long generation's cache (`--cache-mib 1`: 608 KiB each on the tiny
/// preset at 5 + 400 positions), concurrent long requests wait their turn for the batch
/// instead of being refused or failing, and each still gets its local answer.
#[test]
fn long_generations_wait_for_cache_room_and_get_their_local_answers() {
    let mut swarm = Swarm::start("tiny");
    swarm.add_worker("*:*");
    let (_backbone, addr) = swarm.serve_backbone_with("*:*", &["--cache-mib", "1"]);
    let prompts = ["Once upon a time", "The ledger says", "A worker anywhere"];
    all_get_their_local_answers(&swarm, &addr, &prompts, 400);
}

#[test]
fn bad_requests_get_openai_errors_and_a_full_queue_a_429() {
    let mut swarm = Swarm::start("tiny");
    swarm.add_worker("*:*");
    let (_backbone, addr) =
        swarm.serve_backbone_with("*:*", &["--max-batch", "1", "--max-queued", "1"]);
    for (path, body, status) in [
        ("/v1/completions", "{not json".to_string(), 400),
        ("/v1/completions", r#"{"max_tokens": 3}"#.into(), 400),
        ("/v1/completions", r#"{"prompt": ""}"#.into(), 400),
        ("/v1/completions", r#"{"prompt": "x", "n": 2}"#.into(), 400),
        (
            "/v1/completions",
            r#"{"prompt": "x", "temperature": 3}"#.into(),
            400,
        ),
        (
            "/v1/completions",
            r#"{"prompt": "x", "max_tokens": 0}"#.into(),
            400,
        ),
        (
            "/v1/completions",
            r#"{"prompt": "x", "max_tokens": 100000}"#.into(),
            400,
        ),
        ("/v1/completions", r#"{"prompt": ["a", "b"]}"#.into(), 400),
        (
            "/v1/completions",
            r#"{"prompt": "x", "stop": ["", "y"]}"#.into(),
            400,
        ),
        (
            "/v1/completions",
            r#"{"prompt": "x", "model": "gpt-4"}"#.into(),
            404,
        ),
        ("/v1/chat/completions", r#"{"messages": []}"#.into(), 400),
        (
            "/v1/chat/completions",
            r#"{"messages": [{"role": "wizard", "content": "x"}]}"#.into(),
            400,
        ),
        ("/v1/chat/completions", r#"{"messages": "hi"}"#.into(), 400),
    ] {
        let (got, reply) = http(&addr, "POST", path, &body);
        assert_eq!(got, status, "{body}: {reply}");
        let error: ErrorResponse = serde_json::from_str(&reply)
            .unwrap_or_else(|e| panic!("{body}: not an OpenAI error ({e}): {reply}"));
        assert!(!error.error.message.is_empty());
    }
    // More than the model's context holds is that API's own error.
    let (got, reply) = http(
        &addr,
        "POST",
        "/v1/completions",
        r#"{"prompt": "x", "max_tokens": 4000}"#,
    );
    assert_eq!(got, 400, "{reply}");
    let error: ErrorResponse = serde_json::from_str(&reply).unwrap();
    assert_eq!(
        error.error.code.as_deref(),
        Some("context_length_exceeded"),
        "{reply}"
    );
    // The old endpoint refuses, before it joins the batch, what the model's context cannot
    // hold (so it cannot fail the step it would share with others).
    let (got, reply) = http(
        &addr,
        "POST",
        "/generate",
        r#"{"prompt": "x", "tokens": 600}"#,
    );
    assert_eq!(got, 422, "{reply}");
    // Too large a body is refused in the same shape.
    let oversized = format!(r#"{{"prompt": "{}"}}"#, "a".repeat(100_000));
    let (got, reply) = http(&addr, "POST", "/v1/completions", &oversized);
    assert_eq!(got, 413);
    assert!(
        serde_json::from_str::<ErrorResponse>(&reply).is_ok(),
        "{reply}"
    );

    // One long generation holds the batch of one; of two more, one waits and one is told 429.
    let mut running = TcpStream::connect(&addr).unwrap();
    let long = serde_json::json!({"prompt": PROMPT, "max_tokens": 400, "temperature": 0.5,
        "seed": 3, "stream": true})
    .to_string();
    write!(
        running,
        "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{long}",
        long.len()
    )
    .unwrap();
    let mut reader = BufReader::new(running.try_clone().unwrap());
    let mut line = String::new();
    while !line.starts_with("data:") {
        line.clear();
        assert!(
            reader.read_line(&mut line).unwrap() > 0,
            "the stream ended early"
        );
    }
    let statuses: Vec<u16> = std::thread::scope(|scope| {
        // One of them streamed: a full queue is a 429 before any event, streamed or not.
        let handles: Vec<_> = [false, true]
            .into_iter()
            .map(|stream| {
                let addr = addr.clone();
                scope.spawn(move || {
                    let ask = serde_json::json!({"prompt": "x", "max_tokens": 2, "stream": stream});
                    post(&addr, "/v1/completions", &ask).0
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(statuses.contains(&429), "{statuses:?}");
    assert!(statuses.contains(&200), "{statuses:?}");
    drop(reader);
    drop(running);
    // The backbone still serves after its caller hung up mid-stream.
    let ask = serde_json::json!({"prompt": PROMPT, "max_tokens": 2});
    assert_eq!(post(&addr, "/v1/completions", &ask).0, 200);
}

/// The value of `name` in the backbone's `/metrics`.
fn metric(addr: &str, name: &str) -> u64 {
    let (status, text) = http(addr, "GET", "/metrics", "");
    assert_eq!(status, 200, "{text}");
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in {text}"))
}

/// Waits until `/metrics` says `name` is `want`; a minute without fails the test.
fn until(addr: &str, name: &str, want: u64) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let now = metric(addr, name);
        if now == want {
            return;
        }
        assert!(Instant::now() < deadline, "{name} is {now}, not {want}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A caller who hangs up mid-generation, streamed or not, ends it: its sequence leaves the
/// batch long before its 500 tokens (counted as hung up, never as completed), and the
/// backbone serves the next caller.
#[test]
fn a_caller_who_hangs_up_mid_generation_ends_it() {
    let mut swarm = Swarm::start("tiny");
    swarm.add_worker("*:*");
    let (_backbone, addr) = swarm.serve_backbone_with("*:*", &[]);
    let running = "kvasir_backbone_running_sequences";
    let completed = "kvasir_backbone_generations_completed_total";
    let tokens = "kvasir_backbone_generated_tokens_total";
    for (stream, hung_up) in [(true, 1), (false, 2)] {
        let told = metric(&addr, tokens);
        let ask = serde_json::json!({"prompt": PROMPT, "max_tokens": 500, "temperature": 0,
            "stream": stream})
        .to_string();
        let mut caller = TcpStream::connect(&addr).unwrap();
        write!(
            caller,
            "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{ask}",
            ask.len()
        )
        .unwrap();
        // It runs, and has its first tokens.
        while metric(&addr, tokens) == told {
            std::thread::sleep(Duration::from_millis(5));
        }
        drop(caller);
        until(&addr, "kvasir_backbone_generations_hung_up_total", hung_up);
        until(&addr, running, 0);
        assert_eq!(metric(&addr, completed), 0, "stream: {stream}");
    }
    let ask = serde_json::json!({"prompt": PROMPT, "max_tokens": 2});
    assert_eq!(post(&addr, "/v1/completions", &ask).0, 200);
    assert_eq!(metric(&addr, completed), 1);
}

/// Through the gateway one address has at most `--max-generations-per-ip` requests in
/// progress: with 1, another request while a stream runs is a 429 in that API's shape; when
/// the streaming client hangs up its place comes back, and the backbone ends its generation.
#[test]
fn the_gateway_caps_requests_in_progress_per_address() {
    let mut swarm = Swarm::start("tiny");
    swarm.add_worker("*:*");
    let (_backbone, addr) = swarm.serve_backbone_with("*:*", &[]);
    let backbone = format!("http://{addr}");
    swarm.restart_gateway_with(&["--backbone", &backbone, "--max-generations-per-ip", "1"]);
    let (gateway, cert) = (swarm.gateway_addr.clone(), swarm.cert());
    let long = serde_json::json!({"prompt": PROMPT, "max_tokens": 500, "temperature": 0,
        "stream": true})
    .to_string();
    let mut streaming = HttpsCall::send(&gateway, &cert, "POST", "/v1/completions", &long);
    streaming.read_until("data:");
    let (status, body) = https(&gateway, &cert, "GET", "/v1/models", "");
    assert_eq!(status, 429, "{body}");
    let error: ErrorResponse = serde_json::from_str(&body).unwrap();
    assert_eq!(error.error.kind, "rate_limit_error");
    assert_eq!(
        error.error.code.as_deref(),
        Some("too_many_requests_in_progress")
    );
    let (_, metrics) = https(&gateway, &cert, "GET", "/metrics", "");
    for outcome in ["relayed", "refused"] {
        let line = format!("kvasir_gateway_inference_requests_total{{outcome=\"{outcome}\"}} 1\n");
        assert!(metrics.contains(&line), "{line} in {metrics}");
    }
    drop(streaming);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (status, body) = https(&gateway, &cert, "GET", "/v1/models", "");
        if status == 200 {
            break;
        }
        assert_eq!(status, 429, "{body}");
        assert!(Instant::now() < deadline, "the place never came back");
        std::thread::sleep(Duration::from_millis(20));
    }
    until(&addr, "kvasir_backbone_generations_hung_up_total", 1);
    assert_eq!(
        metric(&addr, "kvasir_backbone_generations_completed_total"),
        0
    );
}
