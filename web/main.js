// The diffcast page: camera in, stylized video out; WebRTC first, WebSocket fallback when ICE fails.
import { fitPane, followAspect } from "./aspect.js";
import { setupCamera } from "./camera.js";
import { setupCues } from "./cues.js";
import { openMedia, playOutput, setupRecording } from "./record.js";
import { connectWebRTC, logIn } from "./rtc.js";
import { statCells } from "./stats.js";
import { connectWebSocket } from "./wsclient.js";

const $ = (id) => document.getElementById(id);
const query = new URLSearchParams(window.location.search);
const ICE_TIMEOUT_MS = Number(query.get("ice_timeout_ms") || 8000);

// State other code (and the browser tests) can read.
const state = {
  status: "idle",
  transport: null,
  streamId: null,
  outputFrames: 0,
  stats: null,
  errors: [],
  snapshot: () => snapshot(),
};
window.diffcast = state;

let config = null;
let camera = null;
// Camera, resolution, mirror, layout, full screen, snapshot (web/camera.js).
const cameraChoices = setupCamera({ onError: (text) => notice(text) });
state.camera = cameraChoices;
let connection = null;
let paused = false;
let recording = null; // record.js: microphone, server recording, client-side clip
let cuePanel = null; // cues.js: the stream's cue list, fired by button or keys 1-9

function setStatus(status) {
  state.status = status;
  $("status").textContent = status;
  $("status").dataset.state = status;
}

function notice(text) {
  $("notice").textContent = text;
  $("notice").hidden = !text;
}

function options() {
  return {
    prompt: $("prompt").value.trim() || config.defaultPrompt,
    noise_scale: Number($("noise").value),
    steps: Number($("steps").value),
    seed: Number($("seed").value) || 0,
    stabilize: $("stabilize").checked,
  };
}

function renderStats(stats) {
  state.stats = stats;
  for (const [key, text] of Object.entries(statCells(stats))) $(`stat-${key}`).textContent = text;
  recording.onStats(stats);
}

// What the prompt is served as on a model with looks: "look: pencil sketch 50 % · watercolor 50 %".
function showLooks(looks) {
  const shown = (looks || []).filter((item) => item.share >= 0.05);
  $("looks").textContent = shown.length
    ? `look: ${shown.map((item) => `${item.look} ${Math.round(item.share * 100)} %`).join(" · ")}` : "";
  $("looks").hidden = !shown.length;
}

function onMessage(message) {
  if (message.type === "stats") renderStats(message);
  else if (message.type === "ack" && "notice" in message) {  // a new prompt: far or near, and its looks
    notice(message.notice || "");
    showLooks(message.looks);
  }
  else if (message.type === "error") {
    state.errors.push(message.message);
    notice(`server: ${message.message}`);
  } else if (message.type === "closed" && state.status === "live") {
    setStatus("disconnected");
    notice(`Connection lost${message.reason ? ` (${message.reason})` : ""}. Press Stop, then Start to reconnect.`);
  }
}

function countVideoFrames(video) {
  const step = () => {
    state.outputFrames += 1;
    video.requestVideoFrameCallback(step);
  };
  video.requestVideoFrameCallback(step);
}

function showOutput(kind) {
  $("output").hidden = kind !== "video";
  $("output-canvas").hidden = kind !== "canvas";
}

function snapshot(size = 32) {
  // Output pixels, downsampled: lets tests (and curious users) compare what is on screen.
  const source = $("output").hidden ? $("output-canvas") : $("output");
  const canvas = document.createElement("canvas");
  canvas.width = size;
  canvas.height = size;
  const context = canvas.getContext("2d", { willReadFrequently: true });
  context.drawImage(source, 0, 0, size, size);
  return Array.from(context.getImageData(0, 0, size, size).data);
}

async function start() {
  $("start").disabled = true;
  notice("");
  setStatus("connecting");
  try {
    camera = await openMedia(cameraChoices.open);
    $("input").srcObject = camera;
    if (query.get("transport") !== "ws") {
      try {
        connection = await connectWebRTC({
          camera,
          config,
          options: options(),
          iceTimeoutMs: ICE_TIMEOUT_MS,
          onTrack: (stream) => playOutput($("output"), stream),
          onMessage,
        });
        showOutput("video");
      } catch (error) {
        if (error.status) throw error; // the server refused the stream: a fallback would be refused too
        notice(`WebRTC could not connect (${error.message}); switched to the WebSocket fallback.`);
      }
    }
    if (!connection) {
      connection = await connectWebSocket({
        cameraVideo: $("input"),
        config,
        options: options(),
        canvas: $("output-canvas"),
        onFrame: () => {
          state.outputFrames += 1;
          fitPane($("output-canvas"), $("output-canvas").width, $("output-canvas").height);
        },
        onMessage,
      });
      showOutput("canvas");
    }
    state.transport = connection.transport;
    state.streamId = connection.streamId;
    if (connection.notice) notice(connection.notice);
    showLooks(connection.looks);
    $("transport").textContent = connection.transport === "webrtc" ? "WebRTC" : "WebSocket fallback";
    if (connection.streamId) {
      $("view-link").href = `/view/${connection.streamId}?token=${connection.viewerToken}`;
      $("view-link").hidden = false; // WHEP viewers work for either transport
    }
    cameraChoices.attach(camera, connection);
    setStatus("live");
    recording.connected(connection);
    cuePanel.connected(connection);
    $("stop").disabled = false;
    $("pause").disabled = false;
  } catch (error) {
    if (error.status === 401) return logIn();
    notice(`Could not start: ${error.message}`);
    await stop();
    setStatus("error");
  }
}

async function stop() {
  setStatus("stopping"); // a deliberate close is not a lost connection
  cameraChoices.detach();
  if (connection) await connection.close();
  if (connection) recording.disconnected();
  if (connection) cuePanel.disconnected();
  connection = null;
  if (camera) camera.getTracks().forEach((track) => track.stop());
  camera = null;
  paused = false;
  $("pause").textContent = "Pause";
  $("start").disabled = false;
  $("stop").disabled = true;
  $("pause").disabled = true;
  state.transport = null;
  $("transport").textContent = "";
  setStatus("idle");
}

function sendUpdate(fields) {
  if (connection) connection.send({ type: "update", ...fields });
}

function buildPresets() {
  for (const preset of config.presets) {
    const button = document.createElement("button");
    button.type = "button";
    button.textContent = preset;
    button.addEventListener("click", () => {
      $("prompt").value = preset;
      sendUpdate({ prompt: preset, transition_chunks: 2 });
    });
    $("presets").append(button);
  }
}

async function init() {
  config = await (await fetch("/api/config")).json();
  $("prompt").value = config.defaultPrompt;
  $("prompt").maxLength = config.maxPromptChars;
  // The model's own operating point (the embedded model is trained for low noise and one step).
  if (config.defaultNoiseScale != null) $("noise").value = config.defaultNoiseScale;
  if (config.defaultSteps != null) $("steps").value = config.defaultSteps;
  $("noise-value").textContent = Number($("noise").value).toFixed(2);
  $("steps-value").textContent = $("steps").value;
  buildPresets();
  recording = setupRecording({ $, state, config, output: $("output"), canvas: $("output-canvas"), notice });
  cuePanel = setupCues({ $, notice });
  countVideoFrames($("output"));
  followAspect($("input"));
  followAspect($("output"));
  $("prompt-form").addEventListener("submit", (event) => {
    event.preventDefault();
    sendUpdate({ prompt: options().prompt, transition_chunks: 2 });
  });
  for (const id of ["noise", "steps"]) {
    $(id).addEventListener("input", () => {
      $(`${id}-value`).textContent = id === "noise" ? Number($(id).value).toFixed(2) : $(id).value;
    });
  }
  $("noise").addEventListener("change", () => sendUpdate({ noise_scale: options().noise_scale }));
  $("steps").addEventListener("change", () => sendUpdate({ steps: options().steps }));
  $("seed").addEventListener("change", () => sendUpdate({ seed: options().seed }));
  $("stabilize").addEventListener("change", () => sendUpdate({ stabilize: options().stabilize }));
  $("start").addEventListener("click", start);
  $("stop").addEventListener("click", stop);
  $("pause").addEventListener("click", () => {
    paused = !paused;
    connection?.send({ type: paused ? "pause" : "resume" });
    $("pause").textContent = paused ? "Resume" : "Pause";
  });
  if (query.get("autostart") === "1") start();
}

init().catch((error) => notice(`Could not load the server configuration: ${error.message}`));
