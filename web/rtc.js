// WebRTC client for the page: camera out, stylized video in, JSON control on a data channel.

function waitForGathering(pc, timeoutMs) {
  // The server does not take trickled candidates: send the offer once gathering is done.
  if (pc.iceGatheringState === "complete") return Promise.resolve();
  return new Promise((resolve) => {
    const done = () => {
      if (pc.iceGatheringState !== "complete") return;
      pc.removeEventListener("icegatheringstatechange", done);
      resolve();
    };
    pc.addEventListener("icegatheringstatechange", done);
    setTimeout(resolve, timeoutMs);
  });
}

function waitForConnection(pc, timeoutMs) {
  return new Promise((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error(`ICE did not connect within ${timeoutMs} ms`)), timeoutMs);
    const check = () => {
      if (pc.connectionState === "connected") {
        clearTimeout(timer);
        resolve();
      } else if (pc.connectionState === "failed" || pc.connectionState === "closed") {
        clearTimeout(timer);
        reject(new Error(`ICE ${pc.connectionState}`));
      }
    };
    pc.addEventListener("connectionstatechange", check);
    check();
  });
}

// The server has --api-token and this browser holds no login cookie: its form, then back here.
export function logIn() {
  const next = window.location.pathname + window.location.search;
  window.location.assign(`/login?next=${encodeURIComponent(next)}`);
}

// The camera's frames go out scaled down to the stream's size (the stats' width and height), never
// below it: the server would decode every pixel beyond it only to throw it away (a 640x480 camera
// for a 288x224 stream: 1.7 ms of the server's CPU per frame instead of 0.44; docs/service.md,
// "Sending at the stream's size"), and the browser encodes and sends a fifth of the pixels. Checked
// at every stats message, so a camera switch or a resolution change is followed within a second.
export async function sendAtStreamSize(pc, width, height) {
  const sender = pc.getSenders().find((s) => s.track && s.track.kind === "video");
  if (!sender || !width || !height) return;
  const { width: cameraWidth, height: cameraHeight } = sender.track.getSettings();
  if (!cameraWidth || !cameraHeight) return;
  // Rounded down, so that both sides stay at least the stream's (the server crops, never stretches).
  const scale = Math.max(1, Math.floor(100 * Math.min(cameraWidth / width, cameraHeight / height)) / 100);
  const parameters = sender.getParameters();
  const encoding = parameters.encodings && parameters.encodings[0];
  if (!encoding || Math.abs((encoding.scaleResolutionDownBy || 1) - scale) < 0.01) return;
  encoding.scaleResolutionDownBy = scale;
  await sender.setParameters(parameters);
}

export async function connectWebRTC({ camera, config, options, onTrack, onMessage, iceTimeoutMs }) {
  const pc = new RTCPeerConnection({ iceServers: config.iceServers });
  for (const track of camera.getVideoTracks()) pc.addTransceiver(track, { direction: "sendrecv" });
  // The microphone: its audio comes back delayed to match the stylized video (docs/service.md).
  for (const track of camera.getAudioTracks()) pc.addTransceiver(track, { direction: "sendrecv" });
  const channel = pc.createDataChannel("control");
  channel.onmessage = (event) => {
    const message = JSON.parse(event.data);
    if (message.type === "stats") {
      sendAtStreamSize(pc, message.width, message.height).catch((error) => console.warn(`sender scale: ${error}`));
    }
    onMessage(message);
  };
  const output = new MediaStream(); // the stylized video and its audio, played in one element
  pc.ontrack = (event) => {
    output.addTrack(event.track);
    onTrack(output);
  };

  let streamId = null;
  let ownerToken = null; // the stream's owner capability: only it may stop the stream
  let viewerToken = null; // its viewer capability: the view link carries it
  let farNotice = null; // the prompt is far from every look the model ships: names the nearest
  let looks = []; // the looks the prompt is served as, with their shares (a model with looks)
  const close = async () => {
    pc.close();
    if (streamId) {
      const headers = { Authorization: `Bearer ${ownerToken}` };
      await fetch(`/api/streams/${streamId}`, { method: "DELETE", headers }).catch(() => {});
    }
  };
  try {
    await pc.setLocalDescription(await pc.createOffer());
    await waitForGathering(pc, 3000);
    const response = await fetch("/api/offer", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ sdp: pc.localDescription.sdp, type: "offer", ...options }),
    });
    const body = await response.json().catch(() => ({}));
    if (!response.ok) {
      const error = new Error(body.detail || `offer refused (${response.status})`);
      error.status = response.status;
      throw error;
    }
    streamId = body.stream_id;
    ownerToken = body.owner_token;
    viewerToken = body.viewer_token;
    farNotice = body.notice || null;
    looks = body.looks || [];
    await pc.setRemoteDescription({ type: "answer", sdp: body.sdp });
    await waitForConnection(pc, iceTimeoutMs);
  } catch (error) {
    await close();
    throw error;
  }
  pc.addEventListener("connectionstatechange", () => {
    if (pc.connectionState === "failed" || pc.connectionState === "closed") {
      onMessage({ type: "closed", reason: `WebRTC ${pc.connectionState}` });
    }
  });
  return {
    transport: "webrtc",
    streamId,
    viewerToken,
    ownerToken,
    notice: farNotice,
    looks,
    pc,
    send: (message) => channel.readyState === "open" && channel.send(JSON.stringify(message)),
    close,
  };
}
