// The server's API as the page calls it: same origin, JSON bodies, the API key (kept in this tab's
// sessionStorage, so it is gone when the tab closes) sent as a Bearer token.

const KEY = "llmx-api-key";

export function apiKey() {
  return sessionStorage.getItem(KEY) ?? "";
}

export function setApiKey(key) {
  if (key) sessionStorage.setItem(KEY, key);
  else sessionStorage.removeItem(KEY);
}

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

// fetch() with the key, and a JSON body when `body` is given; a status other than 2xx throws
// ApiError with the server's message (OpenAI's error object).
export async function call(path, { body, signal } = {}) {
  const headers = {};
  const key = apiKey();
  if (key) headers.Authorization = `Bearer ${key}`;
  const init = { headers, signal };
  if (body !== undefined) {
    init.method = "POST";
    headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  const response = await fetch(path, init);
  if (!response.ok) throw new ApiError(response.status, await messageOf(response));
  return response;
}

export async function getJson(path) {
  return (await call(path)).json();
}

async function messageOf(response) {
  const text = await response.text();
  try {
    return JSON.parse(text).error.message;
  } catch {
    return `${response.status} ${response.statusText}: ${text.slice(0, 200)}`;
  }
}

// The JSON objects of a server-sent event stream, up to OpenAI's "[DONE]". An error object sent
// mid-stream (the status line had gone already) throws ApiError. A consumer that stops early closes
// the stream, which tells the server to stop generating.
export async function* events(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  try {
    yield* parse(reader);
  } finally {
    reader.cancel().catch(() => {}); // an aborted fetch's stream has failed already: nothing to close
  }
}

async function* parse(reader) {
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const data = buffer
        .slice(0, end)
        .split("\n")
        .filter((line) => line.startsWith("data: "))
        .map((line) => line.slice(6))
        .join("\n");
      buffer = buffer.slice(end + 2);
      if (data === "[DONE]") return;
      if (!data) continue;
      const event = JSON.parse(data);
      if (event.error) throw new ApiError(event.error.code ?? 500, event.error.message);
      yield event;
    }
  }
}
