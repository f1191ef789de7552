// The playground's live webcam widget: the page's own WebRTC client (rtc.js, with the WebSocket
// fallback from wsclient.js) mounted inside a Gradio gr.HTML block. Gradio controls outside the
// block call window.diffcastPlayground.setOptions(...) / .apply(); nothing here is Gradio-specific.
import { fitPane, followAspect } from "./aspect.js";
import { connectWebRTC, logIn } from "./rtc.js";
import { statCells } from "./stats.js";
import { connectWebSocket } from "./wsclient.js";

const ICE_TIMEOUT_MS = 8000;
const STATS = [
  ["fps", "output fps"],
  ["latency", "latency"],
  ["slack", "playout slack"],
  ["fidelity", "fidelity"],
  ["dropped", "dropped"],
  ["frames", "frames shown"],
];

const state = {
  status: "idle",
  transport: null,
  streamId: null,
  outputFrames: 0,
  stats: null,
  errors: [],
  paused: false,
  options: null,
  setOptions,
  apply,
};
window.diffcastPlayground = state;

let root = null;
let config = null;
let camera = null;
let connection = null;

const q = (name) => root.querySelector(`[data-dc="${name}"]`);

function setStatus(status) {
  state.status = status;
  q("status").textContent = status;
  q("status").dataset.state = status;
}

function notice(text) {
  q("notice").textContent = text;
  q("notice").hidden = !text;
}

// Controls as the server's control protocol names them: one prompt, or two blended by weight.
function setOptions(options) {
  state.options = { ...state.options, ...options };
}

function controlFields() {
  const o = state.options;
  const second = (o.prompt2 || "").trim();
  const fields = { noise_scale: o.noise_scale, steps: o.steps, seed: o.seed };
  if (second && o.blend > 0) {
    fields.prompt = [o.prompt, second];
    fields.prompt_weights = [1 - o.blend, o.blend];
  } else {
    fields.prompt = o.prompt;
  }
  return fields;
}

// Send the current controls to the running stream (no restart; applied at the next chunk).
function apply(options = {}) {
  setOptions(options);
  if (connection) connection.send({ type: "update", transition_chunks: 2, ...controlFields() });
}

function renderStats(stats) {
  state.stats = stats;
  for (const [key, text] of Object.entries(statCells(stats))) q(key).textContent = text;
  q("prompt-now").textContent = stats.prompt;
}

function onMessage(message) {
  if (message.type === "stats") renderStats(message);
  else if (message.type === "error") {
    state.errors.push(message.message);
    notice(`server: ${message.message}`);
  } else if (message.type === "closed" && state.status === "live") setStatus("disconnected");
}

async function start() {
  q("start").disabled = true;
  notice("");
  setStatus("connecting");
  const { prompt, noise_scale, steps, seed } = state.options;
  const opening = { prompt, noise_scale, steps, seed };
  try {
    camera = await navigator.mediaDevices.getUserMedia({ video: { width: 640, height: 480 }, audio: false });
    q("input").srcObject = camera;
    try {
      connection = await connectWebRTC({
        camera, config, options: opening, iceTimeoutMs: ICE_TIMEOUT_MS,
        onTrack: (stream) => { q("output").srcObject = stream; },
        onMessage,
      });
    } catch (error) {
      if (error.status) throw error; // refused by the server: the fallback would be refused too
      notice(`WebRTC could not connect (${error.message}); switched to the WebSocket fallback.`);
      connection = await connectWebSocket({
        cameraVideo: q("input"), config, options: opening, canvas: q("output-canvas"),
        onFrame: () => {
          state.outputFrames += 1;
          fitPane(q("output-canvas"), q("output-canvas").width, q("output-canvas").height);
        },
        onMessage,
      });
    }
    const webrtc = connection.transport === "webrtc";
    q("output").hidden = !webrtc;
    q("output-canvas").hidden = webrtc;
    state.transport = connection.transport;
    state.streamId = connection.streamId;
    if (connection.notice) notice(connection.notice);
    if (webrtc) {
      q("view-link").href = `/view/${connection.streamId}?token=${connection.viewerToken}`;
      q("view-link").textContent = `/view/${connection.streamId}`;
      q("view-link").hidden = false;
    }
    if (state.options.prompt2 && state.options.blend > 0) apply(); // blends are not an opening option
    setStatus("live");
    q("stop").disabled = false;
    q("pause").disabled = false;
  } catch (error) {
    if (error.status === 401) return logIn(); // the login cookie expired
    notice(`Could not start: ${error.message}`);
    await stop();
    setStatus("error");
  }
}

async function stop() {
  if (connection) await connection.close();
  connection = null;
  if (camera) camera.getTracks().forEach((track) => track.stop());
  camera = null;
  state.transport = null;
  state.paused = false;
  q("pause").textContent = "Pause";
  q("view-link").hidden = true;
  q("start").disabled = false;
  q("stop").disabled = true;
  q("pause").disabled = true;
  setStatus("idle");
}

function markup() {
  const stats = STATS.map(([key, label]) => `<div><dt>${label}</dt><dd data-dc="${key}">–</dd></div>`).join("");
  return `
    <div class="dc-bar">
      <button data-dc="start" class="primary">Start camera</button>
      <button data-dc="pause" disabled>Pause</button>
      <button data-dc="stop" disabled>Stop</button>
      <span data-dc="status" class="badge" data-state="idle">idle</span>
      <span class="dc-now">now: <em data-dc="prompt-now">–</em></span>
      <a data-dc="view-link" target="_blank" hidden></a>
    </div>
    <p data-dc="notice" class="notice" hidden></p>
    <div class="dc-stage">
      <figure class="pane"><video data-dc="input" autoplay muted playsinline></video><figcaption>camera</figcaption></figure>
      <figure class="pane"><video data-dc="output" autoplay muted playsinline></video>
        <canvas data-dc="output-canvas" hidden></canvas><figcaption>stylized</figcaption></figure>
    </div>
    <section class="stats"><dl>${stats}</dl></section>`;
}

export async function mount(element) {
  if (root) return; // Gradio may re-run js_on_load; one widget per page
  root = element;
  root.classList.add("diffcast-live");
  root.innerHTML = markup();
  config = await (await fetch("/api/config")).json();
  state.options = { prompt: config.defaultPrompt, prompt2: "", blend: 0, noise_scale: config.defaultNoiseScale ?? 0.8, steps: config.defaultSteps ?? 2, seed: 0, ...state.options };
  const output = q("output");
  const count = () => {
    state.outputFrames += 1;
    output.requestVideoFrameCallback(count);
  };
  output.requestVideoFrameCallback(count);
  followAspect(q("input"));
  followAspect(output);
  q("start").addEventListener("click", start);
  q("stop").addEventListener("click", stop);
  q("pause").addEventListener("click", () => {
    // Paused: the server stops generating and holds the last frame; resume continues the stream.
    state.paused = !state.paused;
    if (connection) connection.send({ type: state.paused ? "pause" : "resume" });
    q("pause").textContent = state.paused ? "Resume" : "Pause";
  });
  state.ready = true;
}
