// Sound and recording on the page: the microphone (sent with the camera, played back in sync with
// the stylized video), server-side recording (the control field `record`, the owner's recordings
// list) and a client-side clip of what the page shows (MediaRecorder, nothing stored on the server).

const MIC_KEY = "diffcast.microphone";
const CLIP_TYPES = ["video/webm;codecs=vp9,opus", "video/webm;codecs=vp8,opus", "video/webm", "video/mp4"];

export function microphoneWanted() {
  return localStorage.getItem(MIC_KEY) !== "off";
}

async function hasMicrophone() {
  const devices = await navigator.mediaDevices.enumerateDevices().catch(() => []);
  return devices.some((device) => device.kind === "audioinput");
}

// The camera (``open``: camera.js's, with the chosen camera and resolution), with the microphone
// when it is wanted and there is one (else video only: a missing or refused microphone must not
// stop the camera). The local monitor stays muted (no echo).
export async function openMedia(open) {
  if (microphoneWanted() && (await hasMicrophone())) {
    try {
      return await open({ audio: { echoCancellation: true, noiseSuppression: true, channelCount: 2 } });
    } catch (error) {
      if (error.name !== "NotFoundError" && error.name !== "NotAllowedError" && error.name !== "NotReadableError") {
        throw error;
      }
      console.warn(`no microphone (${error.name}): video only`);
    }
  }
  return open({ audio: false });
}

// The stylized output: its video and the delayed audio play together in one element.
export function playOutput(video, stream) {
  if (video.srcObject !== stream) video.srcObject = stream; // a track added later plays as it comes
  if (stream.getAudioTracks().length) video.muted = false; // after the Start click: sound may play
}

function download(blob, filename) {
  const link = document.createElement("a");
  link.href = URL.createObjectURL(blob);
  link.download = filename;
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(link.href), 60_000);
}

function stamp() {
  return new Date().toISOString().replace(/[:.]/g, "-").slice(0, 19);
}

// The buttons and list: #mic, #record, #clip, #recordings. `state` is the page's window.diffcast.
export function setupRecording({ $, state, config, output, canvas, notice }) {
  let connection = null;
  let serverRecording = false;
  let clip = null;
  state.recordings = [];
  state.clipBytes = 0;

  $("mic").checked = microphoneWanted();
  $("mic").addEventListener("change", () => localStorage.setItem(MIC_KEY, $("mic").checked ? "on" : "off"));
  $("record").hidden = !config.recording;
  $("record").title = config.recording ? "record the stylized output on the server" : "";

  const owner = () => (connection && connection.ownerToken ? { Authorization: `Bearer ${connection.ownerToken}` } : null);

  async function listRecordings() {
    const headers = owner();
    if (!connection || !headers) return;
    const base = `/api/streams/${connection.streamId}/recordings`;
    const response = await fetch(base, { headers });
    if (!response.ok) return;
    state.recordings = await response.json();
    const list = $("recordings");
    list.replaceChildren();
    for (const item of state.recordings.filter((r) => !r.recording)) {
      const entry = document.createElement("li");
      const link = document.createElement("a");
      // ?access_token= lets a plain link download it (RFC 6750 §2.3); the token is the owner's own.
      link.href = `${base}/${item.name}?access_token=${encodeURIComponent(connection.ownerToken)}`;
      link.download = `diffcast-${item.started_at || item.name}.mp4`;
      const when = item.started_at ? new Date(item.started_at).toLocaleString() : item.name;
      const size = `${(item.bytes / 1e6).toFixed(1)} MB`;
      link.textContent = `recording ${when} · ${Number(item.duration_s || 0).toFixed(1)} s · ${size} MP4`;
      const remove = document.createElement("button");
      remove.type = "button";
      remove.textContent = "delete";
      remove.addEventListener("click", async () => {
        await fetch(`${base}/${item.name}`, { method: "DELETE", headers });
        listRecordings();
      });
      entry.append(link, " ", remove);
      list.append(entry);
    }
    list.hidden = list.childElementCount === 0;
  }

  function showRecording(on) {
    serverRecording = on;
    $("record").textContent = on ? "■ Stop recording" : "● Record";
    $("record").dataset.on = on ? "1" : "";
  }

  $("record").addEventListener("click", () => {
    if (connection) connection.send({ type: "update", record: !serverRecording });
  });

  function outputStream() {
    if (!output.hidden && output.srcObject) return output.srcObject;
    return canvas.captureStream(30); // the WebSocket fallback draws on a canvas
  }

  $("clip").addEventListener("click", () => {
    if (clip) {
      clip.stop();
      return;
    }
    const type = CLIP_TYPES.find((t) => MediaRecorder.isTypeSupported(t)) || "";
    const recorder = new MediaRecorder(outputStream(), type ? { mimeType: type } : {});
    const parts = [];
    recorder.ondataavailable = (event) => event.data.size && parts.push(event.data);
    recorder.onstop = () => {
      const blob = new Blob(parts, { type: recorder.mimeType || "video/webm" });
      state.clipBytes = blob.size;
      clip = null;
      $("clip").textContent = "⤓ Save clip";
      const extension = blob.type.includes("mp4") ? "mp4" : "webm";
      if (blob.size) download(blob, `diffcast-${stamp()}.${extension}`);
      else notice("The clip is empty: nothing was shown while it recorded.");
    };
    recorder.start(1000);
    clip = recorder;
    $("clip").textContent = "■ Stop clip";
  });

  return {
    connected(next) {
      connection = next;
      $("record").disabled = false;
      $("clip").disabled = false;
      listRecordings();
    },
    disconnected() {
      if (clip) clip.stop();
      showRecording(false);
      $("record").disabled = true;
      $("clip").disabled = true;
      // A recording running at Stop is finished by the server as the stream ends: list it then.
      setTimeout(listRecordings, 2000);
    },
    onStats(stats) {
      const wasRecording = serverRecording;
      if (Boolean(stats.recording) !== serverRecording) showRecording(Boolean(stats.recording));
      if (wasRecording && !stats.recording) {
        if (stats.record_error) notice(`Recording stopped: ${stats.record_error}.`);
        listRecordings();
      }
    },
  };
}
