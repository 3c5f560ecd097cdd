// The page's entry: the API key box, the model's name, then the chat, the placement and the live
// panel. With a key required and none (or a wrong one) typed, every call answers 401: the page says
// so once and starts over when a key is entered.

import { apiKey, getJson, setApiKey } from "./api.js";
import { startChat } from "./chat.js";
import { $ } from "./dom.js";
import { pollServer } from "./live.js";
import { showPlacement } from "./placement.js";

let model = "";

function report(e) {
  $("error").textContent = e.status === 401 ? "This server needs its API key: type it above." : e.message;
}

async function connect() {
  try {
    model = (await getJson("/v1/models")).data[0].id;
    $("model").textContent = model;
    $("error").textContent = "";
    await showPlacement();
  } catch (e) {
    report(e);
  }
}

const key = $("key");
key.value = apiKey();
$("key-form").addEventListener("submit", (e) => e.preventDefault()); // Enter: the change below
key.addEventListener("change", () => {
  setApiKey(key.value.trim());
  connect();
});
startChat(() => model);
pollServer(() => {}); // a failed poll says nothing: connect() has reported why, the next poll retries
connect();
