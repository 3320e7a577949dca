# skein as a container image (used by docker-compose.yml).
FROM rust:1.89-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --locked --release --bin skein

FROM debian:bookworm-slim
# ca-certificates: rustls reads the system roots (SQL Server TLS, Kafka SSL).
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates && rm -rf /var/lib/apt/lists/*
COPY --from=build /src/target/release/skein /usr/local/bin/skein
ENTRYPOINT ["skein"]
