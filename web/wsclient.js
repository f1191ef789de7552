// WebSocket fallback: JPEG frames both ways (binary), control and stats as JSON text.

export function connectWebSocket({ cameraVideo, config, options, canvas, onFrame, onMessage, fps = 20 }) {
  const url = new URL("/ws", window.location.href);
  url.protocol = url.protocol === "https:" ? "wss:" : "ws:";
  for (const [key, value] of Object.entries(options)) {
    if (value !== undefined && value !== null && value !== "") url.searchParams.set(key, value);
  }
  const ws = new WebSocket(url);
  ws.binaryType = "blob";
  // Frames go out at the camera's aspect, as small as the stream's size allows (the stats' width and
  // height, like the WebRTC sender: web/rtc.js), before the first stats with about the model's pixels
  // (config.width x config.height); the server crops the few pixels its size grid cannot hit.
  let stream = null; // the stream's { width, height } from its stats
  const grab = document.createElement("canvas");
  const grabContext = grab.getContext("2d");
  const drawContext = canvas.getContext("2d");
  let timer = null;
  let streamId = null;
  let viewerToken = null; // the stream's viewer capability (docs/security.md)
  let ownerToken = null; // its owner capability: recordings are listed with it

  const sendFrame = () => {
    // Skip a frame rather than queue it: a backlog here would be latency.
    if (ws.readyState !== WebSocket.OPEN || ws.bufferedAmount > 64 * 1024) return;
    if (cameraVideo.readyState < 2) return;
    const w = cameraVideo.videoWidth, h = cameraVideo.videoHeight;
    const scale = Math.min(1, stream ? Math.max(stream.width / w, stream.height / h)
      : Math.sqrt((config.width * config.height) / (w * h)));
    const gw = Math.round(w * scale), gh = Math.round(h * scale);
    if (grab.width !== gw) grab.width = gw;
    if (grab.height !== gh) grab.height = gh;
    grabContext.drawImage(cameraVideo, 0, 0, w, h, 0, 0, gw, gh);
    grab.toBlob((blob) => blob && ws.readyState === WebSocket.OPEN && ws.send(blob), "image/jpeg", 0.8);
  };

  // Ready once the server says hello (the stream exists); a refusal (full, bad option) arrives as
  // an error message followed by a close, and becomes the rejection reason.
  let refusal = "WebSocket connection failed";
  let settle = null;
  const ready = new Promise((resolve, reject) => {
    settle = { resolve, reject };
  });
  ws.onerror = () => settle.reject(new Error(refusal));
  ws.onmessage = async (event) => {
    if (typeof event.data === "string") {
      const message = JSON.parse(event.data);
      if (message.type === "stats" && message.width && message.height) {
        stream = { width: message.width, height: message.height };
      }
      if (message.type === "hello") {
        streamId = message.stream_id;
        viewerToken = message.viewer_token;
        ownerToken = message.owner_token;
        timer = setInterval(sendFrame, 1000 / fps);
        settle.resolve();
      } else if (message.type === "error" && !streamId) {
        refusal = message.message;
      }
      onMessage(message);
      return;
    }
    const bitmap = await createImageBitmap(event.data);
    if (canvas.width !== bitmap.width) canvas.width = bitmap.width;
    if (canvas.height !== bitmap.height) canvas.height = bitmap.height;
    drawContext.drawImage(bitmap, 0, 0);
    bitmap.close();
    onFrame();
  };
  ws.onclose = (event) => {
    clearInterval(timer);
    settle.reject(new Error(refusal));
    onMessage({ type: "closed", code: event.code, reason: event.reason });
  };
  return ready.then(() => ({
    transport: "websocket",
    streamId,
    viewerToken,
    ownerToken,
    send: (message) => ws.readyState === WebSocket.OPEN && ws.send(JSON.stringify(message)),
    close: async () => {
      clearInterval(timer);
      ws.close();
    },
  }));
}
