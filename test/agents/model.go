// Package agents runs real coding-agent CLIs (OpenAI's Codex CLI and
// Anthropic's Claude Code, unmodified, from the npm registry) under
// fenceline against a scripted model: a local server that speaks the wire
// APIs the CLIs use (the Responses API for Codex, the Messages API for
// Claude Code, both streamed as server-sent events) and answers every
// turn with the next shell command of a script, so a run is deterministic.
//
// The tests (agents_test.go) put each CLI through issue 21's story
// (testdata/story.json: one shell command per turn) under "fenceline run"
// and in pod mode ("fenceline sidecar" + "fenceline agent"), each CLI's
// own sandbox and approvals off, and once with fenceline's file guard off,
// which must fail. The model serves TLS for a made-up name from a test CA;
// the agents reach it only through the egress proxy, by that name on the
// allowlist. Everything runs as the user nobody (Claude Code refuses to
// skip its permission checks as root). scripts/agents-e2e.sh runs the
// tests and prints one line per step and agent.
package agents

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"time"
)

// Step is one turn of a script: the shell command the model asks the agent
// to run. Before, when set, runs (blocking the answer) before the command
// is handed out: a test revokes the lease there, so the command runs after
// the loss.
type Step struct {
	Name   string `json:"name"`
	Cmd    string `json:"cmd"`
	Before string `json:"before,omitempty"`
}

// Model is the scripted model server. Its answer to a request is decided
// by how many tool results the request carries: n results ask for step n,
// len(Steps) results get the final message. Retries and replays of a
// conversation therefore get the same answer.
type Model struct {
	Steps []Step
	// Hooks run by name before a step that names them in Before; an error
	// is logged and the step is handed out anyway (the test's assertions
	// then fail on what follows).
	Hooks map[string]func(context.Context) error
	Log   *slog.Logger
	// Key, when set, is the API key every request must carry (OpenAI's
	// Authorization: Bearer or Anthropic's x-api-key): one the agent never
	// held, added by fenceline's egress proxy. Others get 401.
	Key string

	mu      sync.Mutex
	results map[int]string // step index -> the tool output the agent sent back
	hooked  map[string]bool
	reqs    int
	badKeys int  // requests refused for their key
	done    bool // the final answer was served
}

// BadKeys is how many requests came without Key.
func (m *Model) BadKeys() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.badKeys
}

// keyed refuses a request without m.Key (when set).
func (m *Model) keyed(h http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		m.mu.Lock()
		key := m.Key
		bad := key != "" && r.Header.Get("Authorization") != "Bearer "+key && r.Header.Get("X-Api-Key") != key
		if bad {
			m.badKeys++
		}
		m.mu.Unlock()
		if bad {
			m.logger().Info("model: request without the API key", "url", r.URL.String())
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusUnauthorized)
			io.WriteString(w, `{"type":"error","error":{"type":"authentication_error","message":"invalid x-api-key"}}`)
			return
		}
		h(w, r)
	}
}

// SetSteps replaces the script, for a model that serves more than one run
// (a CLI may still be asking as its run ends).
func (m *Model) SetSteps(steps []Step) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.Steps = steps
}

// Finished reports whether the agent came back after the last step and
// was given the final answer: it carried on through the whole script.
func (m *Model) Finished() bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.done
}

// Results returns, for each step answered so far, the output the agent
// reported for it ("" for steps whose result has not come back).
func (m *Model) Results() []string {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make([]string, len(m.Steps))
	for i := range out {
		out[i] = m.results[i]
	}
	return out
}

// Requests is how many model requests were served.
func (m *Model) Requests() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.reqs
}

// Handler serves POST /v1/responses (Codex) and POST /v1/messages
// (Claude Code); anything else is 404.
func (m *Model) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/responses", m.keyed(m.responses))
	mux.HandleFunc("POST /v1/messages", m.keyed(m.messages))
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		m.logger().Info("model: unscripted request", "method", r.Method, "url", r.URL.String())
		http.NotFound(w, r)
	})
	return mux
}

func (m *Model) logger() *slog.Logger {
	if m.Log != nil {
		return m.Log
	}
	return slog.Default()
}

// next records the tool outputs of a request and returns the step to hand
// out (ok false: the script is done), running its hook first once.
func (m *Model) next(ctx context.Context, outputs []string) (Step, int, bool) {
	m.mu.Lock()
	m.reqs++
	if m.results == nil {
		m.results = map[int]string{}
		m.hooked = map[string]bool{}
	}
	for i, o := range outputs {
		if i < len(m.Steps) {
			m.results[i] = o
		}
	}
	n := len(outputs)
	if n >= len(m.Steps) {
		m.done = true
		m.mu.Unlock()
		return Step{}, n, false
	}
	st := m.Steps[n]
	run := st.Before != "" && !m.hooked[st.Before]
	if run {
		m.hooked[st.Before] = true
	}
	m.mu.Unlock()
	if run {
		hook := m.Hooks[st.Before]
		if hook == nil {
			m.logger().Error("model: no hook", "hook", st.Before)
		} else {
			hctx, cancel := context.WithTimeout(ctx, 60*time.Second)
			err := hook(hctx)
			cancel()
			if err != nil {
				m.logger().Error("model: hook failed", "hook", st.Before, "err", err)
			}
		}
	}
	m.logger().Info("model: step", "n", n, "name", st.Name)
	return st, n, true
}

func sse(w http.ResponseWriter) func(event string, data any) {
	w.Header().Set("Content-Type", "text/event-stream")
	w.Header().Set("Cache-Control", "no-cache")
	w.WriteHeader(http.StatusOK)
	fl, _ := w.(http.Flusher)
	return func(event string, data any) {
		b, err := json.Marshal(data)
		if err != nil {
			panic(err) // our own literals
		}
		if event != "" {
			fmt.Fprintf(w, "event: %s\n", event)
		}
		fmt.Fprintf(w, "data: %s\n\n", b)
		if fl != nil {
			fl.Flush()
		}
	}
}

// outputText flattens a tool output that is a string or a list of content
// parts with "text".
func outputText(raw json.RawMessage) string {
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return s
	}
	var parts []struct {
		Text string `json:"text"`
	}
	if json.Unmarshal(raw, &parts) == nil {
		var b strings.Builder
		for _, p := range parts {
			b.WriteString(p.Text)
		}
		return b.String()
	}
	return string(raw)
}

// responses answers a Responses API request (Codex): the next step as an
// exec_command function call, or the final message.
func (m *Model) responses(w http.ResponseWriter, r *http.Request) {
	var req struct {
		Input []struct {
			Type   string          `json:"type"`
			Output json.RawMessage `json:"output"`
		} `json:"input"`
	}
	if err := json.NewDecoder(io.LimitReader(r.Body, 64<<20)).Decode(&req); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	var outs []string
	for _, it := range req.Input {
		if it.Type == "function_call_output" {
			outs = append(outs, outputText(it.Output))
		}
	}
	st, n, ok := m.next(r.Context(), outs)
	send := sse(w)
	id := fmt.Sprintf("resp_%d", n+1)
	send("response.created", map[string]any{"type": "response.created", "response": map[string]any{"id": id}})
	if ok {
		args, _ := json.Marshal(map[string]string{"cmd": st.Cmd})
		send("response.output_item.done", map[string]any{"type": "response.output_item.done", "output_index": 0,
			"item": map[string]any{"type": "function_call", "call_id": fmt.Sprintf("call_%d", n+1), "name": "exec_command", "arguments": string(args)}})
	} else {
		send("response.output_item.done", map[string]any{"type": "response.output_item.done", "output_index": 0,
			"item": map[string]any{"type": "message", "role": "assistant", "id": "msg_done",
				"content": []any{map[string]any{"type": "output_text", "text": "Done", "annotations": []any{}}}}})
	}
	send("response.completed", map[string]any{"type": "response.completed", "response": map[string]any{"id": id,
		"usage": map[string]any{"input_tokens": 1, "input_tokens_details": map[string]any{"cached_tokens": 0},
			"output_tokens": 1, "output_tokens_details": map[string]any{"reasoning_tokens": 0}, "total_tokens": 2}}})
}

// messages answers a Messages API request (Claude Code): the next step as
// a Bash tool_use block, or the final text. A request without tools (a
// side question the CLI asks) gets a short text answer and no step.
func (m *Model) messages(w http.ResponseWriter, r *http.Request) {
	var req struct {
		Tools    []json.RawMessage `json:"tools"`
		Messages []struct {
			Role    string          `json:"role"`
			Content json.RawMessage `json:"content"`
		} `json:"messages"`
	}
	if err := json.NewDecoder(io.LimitReader(r.Body, 64<<20)).Decode(&req); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	send := sse(w)
	start := func() {
		send("message_start", map[string]any{"type": "message_start", "message": map[string]any{
			"id": "msg_1", "type": "message", "role": "assistant", "model": "scripted", "content": []any{},
			"stop_reason": nil, "stop_sequence": nil, "usage": map[string]any{"input_tokens": 1, "output_tokens": 1}}})
	}
	text := func(s string) {
		send("content_block_start", map[string]any{"type": "content_block_start", "index": 0,
			"content_block": map[string]any{"type": "text", "text": ""}})
		send("content_block_delta", map[string]any{"type": "content_block_delta", "index": 0,
			"delta": map[string]any{"type": "text_delta", "text": s}})
		send("content_block_stop", map[string]any{"type": "content_block_stop", "index": 0})
		send("message_delta", map[string]any{"type": "message_delta",
			"delta": map[string]any{"stop_reason": "end_turn", "stop_sequence": nil}, "usage": map[string]any{"output_tokens": 1}})
		send("message_stop", map[string]any{"type": "message_stop"})
	}
	if len(req.Tools) == 0 {
		m.logger().Info("model: side request without tools")
		start()
		text("ok")
		return
	}
	var outs []string
	for _, msg := range req.Messages {
		if msg.Role != "user" {
			continue
		}
		var blocks []struct {
			Type    string          `json:"type"`
			Content json.RawMessage `json:"content"`
			IsError bool            `json:"is_error"`
		}
		if json.Unmarshal(msg.Content, &blocks) != nil {
			continue // a plain string
		}
		for _, b := range blocks {
			if b.Type == "tool_result" {
				o := outputText(b.Content)
				if b.IsError {
					o = "[is_error] " + o
				}
				outs = append(outs, o)
			}
		}
	}
	st, n, ok := m.next(r.Context(), outs)
	start()
	if !ok {
		text("Done")
		return
	}
	input, _ := json.Marshal(map[string]string{"command": st.Cmd, "description": st.Name})
	send("content_block_start", map[string]any{"type": "content_block_start", "index": 0,
		"content_block": map[string]any{"type": "tool_use", "id": fmt.Sprintf("toolu_%d", n+1), "name": "Bash", "input": map[string]any{}}})
	send("content_block_delta", map[string]any{"type": "content_block_delta", "index": 0,
		"delta": map[string]any{"type": "input_json_delta", "partial_json": string(input)}})
	send("content_block_stop", map[string]any{"type": "content_block_stop", "index": 0})
	send("message_delta", map[string]any{"type": "message_delta",
		"delta": map[string]any{"stop_reason": "tool_use", "stop_sequence": nil}, "usage": map[string]any{"output_tokens": 1}})
	send("message_stop", map[string]any{"type": "message_stop"})
}
