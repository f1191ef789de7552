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

export async function connectWebRTC({ camera, config, options, onTrack, onMessage, iceTimeoutMs }) {
  const pc = new RTCPeerConnection({ iceServers: config.iceServers });
  for (const track of camera.getVideoTracks()) pc.addTransceiver(track, { direction: "sendrecv" });
  // The microphone: its audio comes back delayed to match the stylized video (docs/service.md).
  for (const track of camera.getAudioTracks()) pc.addTransceiver(track, { direction: "sendrecv" });
  const channel = pc.createDataChannel("control");
  channel.onmessage = (event) => onMessage(JSON.parse(event.data));
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
